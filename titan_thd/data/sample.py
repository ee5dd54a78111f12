"""Sample: one tokenised training example (token ids + target mask).

Its own module so that the producers (`chat_template`, `token_store`, `packed_dataset`) and the
consumers (`packer`) depend on it and not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sample:
    input_ids: np.ndarray
    """[L] int32 token ids."""
    target_mask: np.ndarray
    """[L] bool: True where token i is a trained target (predicting it from ids[:i] is trained);
    target_mask[0] is always False."""
