"""Model FLOPs of transformer training, for MFU.

Per target token, training = 3 x forward (the backward costs two forwards), and
forward = 2 x the multiply-adds of every GEMM and of the attention products:
  encoder layer, per source token: 4 d^2 (q, k, v, out) + 2 d f (FFN) + 2 S d (scores, context)
  decoder layer, per target token: 4 d^2 (self) + 2 d^2 (cross q, out) + 2 d f + 2 T d + 2 S' d,
                 and per source token 2 d^2 (cross k, v)
  output projection, per target token: d V
with S, T the source and target lengths (S' the source length a target token
attends to: S unless given) and source tokens counted per target token
(src_per_tgt). A padded batch gives its padded lengths; a packed one the real
sentences' averages weighted as attention's work grows (sum of squares over sum).
"""


def training_flops_per_target_token(dim, ffn, encoder_layers, decoder_layers, vocab, src_len, tgt_len, src_per_tgt=1.0,
                                    cross_len=None):
    cross_len = src_len if cross_len is None else cross_len
    encoder = encoder_layers * (4 * dim * dim + 2 * dim * ffn + 2 * src_len * dim) * src_per_tgt
    decoder = decoder_layers * (6 * dim * dim + 2 * dim * ffn + 2 * (tgt_len + cross_len) * dim + 2 * dim * dim * src_per_tgt)
    return 3 * 2 * (encoder + decoder + dim * vocab)
