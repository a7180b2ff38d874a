/* toyharness portable dequantization: the blocks of a frozen weight's type as float32, by our
 * own code (portable_quant.c), the same bits on every CPU and bit for bit gguf-py's numpy
 * dequantizer. The portable mode's frozen products (portable_kernels.c) read weights through it.
 */
#ifndef TOYHARNESS_PORTABLE_QUANT_H
#define TOYHARNESS_PORTABLE_QUANT_H

#include <stdint.h>

/* The types read here, as enum ggml_type's values: this file and portable_quant.c are built
 * without ggml into the self-test too (portable_kernels.c checks the values against ggml.h). */
enum {
    TP_TYPE_F16 = 1, TP_TYPE_Q4_0 = 2, TP_TYPE_Q4_1 = 3, TP_TYPE_Q5_0 = 6, TP_TYPE_Q5_1 = 7, TP_TYPE_Q8_0 = 8,
    TP_TYPE_Q4_K = 12, TP_TYPE_Q5_K = 13, TP_TYPE_Q6_K = 14, TP_TYPE_BF16 = 30,
};

/* values per block of a type read here, or 0 for any other type; bytes per block (0 likewise) */
int tp_quant_block(int type);
int tp_quant_block_bytes(int type);

/* n values (a multiple of the type's block) from the blocks at src into dst */
void tp_dequantize(int type, const void * src, float * dst, int64_t n);

#endif
