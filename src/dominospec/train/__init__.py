"""Training the Domino draft: the pure-torch objective (`objective`) and the Lightning stage around it."""
