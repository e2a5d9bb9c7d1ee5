"""Number formats (checkpoint FP8 e4m3, FP4 e2m1, ue8m0 scales; the FP8 KV cache layout), quantisation
helpers, and the plain maths on them that the op specs, the kernels and the model share."""
