"""kvctl: watch and steer a served engine through its ledger service's live socket (``cli``)."""
