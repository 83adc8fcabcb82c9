"""Draft heads that read the target's own hidden states: EAGLE-style and Medusa."""
