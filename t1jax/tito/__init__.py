"""Token-in-token-out: trajectory stitching, boundary repair, drift audit, routing alignment."""
