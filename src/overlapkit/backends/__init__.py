"""Framework engines beside torch: each in its own package, chosen once (in `run`)."""
