"""l4m: programs (controllers) drive an LLM through the L4M protocol."""
