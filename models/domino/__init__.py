"""The Domino draft: DFlash backbone + causal GRU logit-correction head."""
