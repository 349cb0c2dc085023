import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# Catch silent broadcasting and dtype promotion bugs (as equinox's own tests do).
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def getkey():
    """A fresh PRNG key per call: `getkey()`."""
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    return lambda: next(keys)
