"""The GPU session's checks (run when a GPU is lent): the engine end to end and each Triton kernel."""
