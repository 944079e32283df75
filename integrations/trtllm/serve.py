"""``trtllm-serve`` with kvplug's router hook installed: ``python -m
kvplug.integrations.trtllm.serve disaggregated -c disagg.yaml`` runs TRT-LLM's own CLI
(``tensorrt_llm.commands.serve:main``, its ``trtllm-serve`` console script) in this process,
so a YAML ``router: {type: kvplug, args: {url: ...}}`` works (see ``hook.py``)."""

from __future__ import annotations

import sys

from .hook import install


def main(argv: list[str] | None = None) -> int:
    install()
    from tensorrt_llm.commands.serve import main as trtllm_serve

    sys.argv = ["trtllm-serve", *(sys.argv[1:] if argv is None else argv)]
    result = trtllm_serve()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
