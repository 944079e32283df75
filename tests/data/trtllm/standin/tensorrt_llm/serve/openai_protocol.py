"""Stand-in request models: pydantic, ``extra="forbid"``, the fields the hook test sends."""

from pydantic import BaseModel, ConfigDict


class DisaggregatedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_type: str
    ctx_request_id: int | None = None
    encoded_opaque_state: str | None = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = None
    stream: bool | None = False
    disaggregated_params: DisaggregatedParams | None = None
