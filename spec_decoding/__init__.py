"""spec_decoding: speculative decoding (drafter and verifier over netproto)."""
