import numpy as np
import numpy.typing as npt

def parse_token_ids(raw: bytes | memoryview) -> npt.NDArray[np.uint32] | None: ...
