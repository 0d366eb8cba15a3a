"""Host side of the device programs: one `Runner` interface over a ragged token batch, its
XLA and Pallas implementations, shape buckets, and the factory every engine uses."""
