"""Recorded GPU data: the replay recording is installed as tuner.recordings, for the analysis notebook outside a
checkout (see README.md here)."""
