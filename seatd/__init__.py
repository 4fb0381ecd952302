"""seatd: the supervisor of local seats, and the seat worker it spawns."""
