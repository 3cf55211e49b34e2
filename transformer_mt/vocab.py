"""The fixed special ids of every SentencePiece model we train: what model, search and data need
of the tokenizer, without importing SentencePiece."""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
