"""Training what specserve drafts with (`specserve train-drafter`)."""
