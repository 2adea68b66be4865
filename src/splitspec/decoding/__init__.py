"""Token selection and generation loops shared by split, local and federated decoding."""
