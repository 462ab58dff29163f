"""dpresearch: communication-efficient distributed SGD research framework."""
