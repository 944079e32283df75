import numpy as np
import numpy.typing as npt

def parse_token_ids(raw: bytes | memoryview) -> npt.NDArray[np.uint32] | None: ...
def read_common_completion(
    raw: bytes,
) -> tuple[str, npt.NDArray[np.uint32], bool, str | None] | None: ...
