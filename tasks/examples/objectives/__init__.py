"""The pretraining objectives as vectorised NumPy cores: BERT masking, T5 spans, BART noise.

One module per objective (`masking`, `spans`, `denoising`) over the counter-based random numbers
they share (`rng`). The example stage writes their output into shards; the training loop's
dynamic masking calls the same functions, so both draw the same masks for a sample.
"""
