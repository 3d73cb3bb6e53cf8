"""The checkpoint directory: record format, store, locks, leftovers, durable-write primitives, tensor layout."""
