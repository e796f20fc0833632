//! \file decodeAttention.h
//! The CPU kernel of dflash2.DecodeAttention: GroupQueryAttention (packed QKV, rotary non-interleaved, causal,
//! one sequence) over a capacity KV buffer, written for the few new rows of a decode or verify step.
//!
//! Why not ORT's GroupQueryAttention: its CPU kernel runs Q x K' and P x V as one small GEMM per query head
//! (MLAS packs K' and, for more than one row, V per head per call), so a 2-row call costs about twice a
//! 1-row call at long contexts. Here the query rows of the heads sharing a key/value head walk its keys and
//! values once, in blocks that stay in L1 for all of them, and a row's
//! output does not depend on how many rows share the call: row i of a k-row call equals the 1-row call at
//! that position bit for bit (the property the lossless verify relies on).
//!
//! No ONNX Runtime headers: the op wrapper (ortCustomOp.cpp) calls this with raw pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dflash2
{

struct DecodeAttentionShape
{
    int64_t rows;       //!< S: new rows (positions past .. past+S-1)
    int64_t past;       //!< P: valid cached positions before the new rows
    int64_t capacity;   //!< C: slots of the KV buffers
    int64_t numHeads;   //!< query heads
    int64_t kvHeads;    //!< key/value heads (numHeads % kvHeads == 0)
    int64_t headDim;    //!< d (even)
    int64_t ropeRows;   //!< rows of the cos/sin tables (> P + S - 1)
    float scale;        //!< softmax scale (0: 1/sqrt(d))
};

//! Step 1 (serial, cheap): rotate the new keys and write keys and values of rows 0..S-1 into slots P..P+S-1.
//! qkv [S, (numHeads + 2 kvHeads) d]; keyCache / valueCache [kvHeads, C, d]; cos / sin [ropeRows, d/2].
void decodeAttentionWriteKv(DecodeAttentionShape const& s, float const* qkv, float const* cosTable,
    float const* sinTable, float* keyCache, float* valueCache) noexcept;

//! Step 2 (parallel over query heads): out [S, numHeads d] rows for heads [headBegin, headEnd). Heads of the range
//! that share a key/value head make one pass over its keys and values (read once for all their rows); a row's
//! numbers do not depend on the range.
//! scratch: decodeAttentionScratch(s) floats per call.
void decodeAttentionHeads(DecodeAttentionShape const& s, float const* qkv, float const* cosTable,
    float const* sinTable, float const* keyCache, float const* valueCache, float* out, int64_t headBegin,
    int64_t headEnd, float* scratch) noexcept;

//! Step 2 as above for the queries [queryBegin, queryEnd) of the list query i = head i / S, row i % S (each head's
//! rows in order, heads in order): the parallel loop's unit, so a few threads can share even one key/value head's
//! rows. A row's numbers depend neither on the range nor on where it is cut.
//! scratch: decodeAttentionScratch(s) floats per call.
void decodeAttentionQueries(DecodeAttentionShape const& s, float const* qkv, float const* cosTable,
    float const* sinTable, float const* keyCache, float const* valueCache, float* out, int64_t queryBegin,
    int64_t queryEnd, float* scratch) noexcept;

//! A range of queries for decodeAttentionQueries and its cost (the keys its queries attend to).
struct QueryRange
{
    int64_t begin;
    int64_t end;
    int64_t cost;
};

//! Pieces each group is cut into in a call with `groups` groups (key/value heads x sequences): 1 (whole groups)
//! where they are 8 or more, else as many as make 6 items or more. Each piece of a group reads its keys and values
//! once: more pieces than threads need cost more than they balance (12 pieces of SmolLM2's 3 groups at 2000 cached
//! positions: +10 % CPU time at 48 rows, +40 % at 8).
int64_t decodeAttentionPieces(int64_t groups) noexcept;

//! The parallel loop's units for one sequence of shape s: the queries of each key/value head's group of query heads
//! cut into min(pieces, its queries) ranges of (nearly) equal cost -> appended to out, groups in order. Cut
//! between rows of a head where it has 8 rows or more, else between heads only.
void decodeAttentionCut(DecodeAttentionShape const& s, int64_t pieces, std::vector<QueryRange>& out);

//! Floats of scratch decodeAttentionHeads / decodeAttentionQueries need.
int64_t decodeAttentionScratch(DecodeAttentionShape const& s) noexcept;

} // namespace dflash2
