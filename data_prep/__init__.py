"""Code-corpus pipeline: raw source files -> filtered, deduplicated, redacted, decontaminated, packed shards."""
