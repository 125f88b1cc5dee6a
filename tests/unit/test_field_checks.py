import math
from dataclasses import dataclass

import pytest

from shared.field_checks import require_at_least, require_positive


@dataclass
class Fields:
    a: float = 1.0
    b: int = 2


def test_positive_fields_pass_and_the_first_bad_one_is_named():
    require_positive(Fields(), "a", "b")
    with pytest.raises(ValueError, match=r"^b must be > 0, got 0$"):
        require_positive(Fields(b=0), "a", "b")
    with pytest.raises(ValueError, match=r"^a must be > 0, got -0.5$"):
        require_positive(Fields(a=-0.5, b=0), "a", "b")
    with pytest.raises(ValueError, match=r"^a must be > 0, got nan$"):
        require_positive(Fields(a=math.nan), "a")


def test_at_least_takes_the_minimum_itself():
    require_at_least(Fields(b=1), 1, "b")
    with pytest.raises(ValueError, match=r"^b must be >= 2, got 1$"):
        require_at_least(Fields(b=1), 2, "b")
