"""Drop-in front ends: other libraries' signatures, layouts and semantics on eqx_flash's
kernels, converted at their edge."""
