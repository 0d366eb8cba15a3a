"""KV plumbing both worker tiers share: page allocation with prefix sharing, block hashes,
the claim-a-prefix step, and the KV wire format (build, validate, stage)."""
