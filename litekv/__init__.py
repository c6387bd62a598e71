"""litekv: on-device LLM runtime with the KV cache as a first-class object."""
