"""fed_learn: federated LoRA fine-tuning (coordinator + clients over netproto)."""
