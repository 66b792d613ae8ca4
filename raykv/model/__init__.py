"""Real models on the paged KV cache: a Llama-family decoder whose attention reads and writes a
rank's KV pages in place, its checkpoint description and its weights (torch, no ray)."""
