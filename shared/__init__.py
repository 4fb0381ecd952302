"""What more than one Sanctum process must agree on.

The wire protocol, the config schema, cap arithmetic, counter names and logging
set-up live here, so that proxyd, seatd and the seat workers cannot drift apart.
"""
