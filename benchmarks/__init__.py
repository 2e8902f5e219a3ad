"""Reproductions of the PagedAttention paper's measurements (`paged-backend bench NAME`)."""
