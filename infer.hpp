// infer.hpp — the LLM inference stack, layer by layer, in one readable header.
// SPDX-License-Identifier: MIT (see LICENSE). Version INFER_VERSION_STRING, defined below.
//
// A checkpoint on disk becomes text through a chain of layers. This header holds the inference engine's layers in the
// order a request's data flows through them. Each section is numbered by the chapter of the course that teaches it, so
// `grep -n '^// ====' infer.hpp` is the table of contents:
//
//   01 The stack          errors, timers, the JSON value and the thread pool every layer shares          (chapter 01)
//   02 Weights on disk    safetensors (+ config.json), GGUF, llama2.c .bin → one Model                    (chapter 02)
//   03 Tokenizer          text ↔ ids: SentencePiece scores and Hugging Face BPE; streaming decode        (chapter 03)
//   04 Forward pass       ids → logits for a batch (prefill and decode), grammars, the sampler, one request (chapter 04)
//   05 KV cache           blocks, block tables, prefix sharing and LRU eviction                          (chapter 05)
//   06 Scheduler          continuous batching, the Engine (step → events), EngineLoop, traces          (chapter 06)
//   07 Hardware           cpu or cuda behind one forward pass (kernels in infer_cuda.cu)                (chapter 07)
//   A–J Appendices        the plumbing the lessons call: JSON parsing, 16-bit floats and the thread pool's
//                         insides, Unicode data and NFC, the regex engine, the tokenizer.json pipeline,
//                         the SIMD kernels, random-weight models, the decoders of GGUF's quantized blocks,
//                         quantizing, and structured outputs' regular expressions and JSON Schemas.
//                         Each is declared where a lesson uses it.
//
// The map: one request through generate_from_ids() (section 04), the shortest path through every layer.
//
//   Model model = load_model(path);         02  mmap the file, read config + tensor table, check every shape
//   Tokenizer tok = tokenizer_for(model);   03  the vocabulary the file carries (or tokenizer.json beside it)
//   ids = tok.encode(prompt);               03  normalize, pre-tokenize, merge pairs until none merges
//   KVCache cache(config, blocks);          04  storage for every layer's K and V; 05 hands out its blocks
//   batch = all prompt ids;                 04  prefill: T tokens in one forward call, compute-bound
//   logits = forward.forward(batch, cache); 04  per layer: norm → q,k,v → RoPE → attention → MLP
//   next = sampler.sample(logits);          04  penalties, temperature, top-k/p, min-p, a seeded draw
//   batch = {next}; repeat                  04  decode: one token per step, memory-bound (07 measures it)
//   text += stream.push(next);              03  ids back to text, one whole character at a time
//
// The Engine (section 06) runs the same loop for many requests at once: its scheduler fills each forward call with
// one decode token per running request plus chunks of new prompts; the serving framework (tools/) puts HTTP in front.
//
// Quick start, one request (save as quick.cpp beside this header; g++ -std=c++20 -O2 -pthread quick.cpp):
//
//   #include "infer.hpp"
//   #include <iostream>
//   int main() {
//       infer::Model model = infer::load_model("stories260K.gguf");
//       infer::ThreadPool pool;                       // all cores
//       infer::SamplingParams params;                 // defaults; temperature 0 is greedy
//       params.temperature = 0;
//       params.max_tokens = 64;
//       infer::generate(model, pool, "Once upon a time", params,
//                       [](std::string_view text) { std::cout << text << std::flush; });
//   }
//
// Quick start, many requests through the engine (paged KV cache, continuous batching):
//
//   #include "infer.hpp"
//   #include <iostream>
//   int main() {
//       infer::Model model = infer::load_model("stories260K.gguf");
//       infer::ThreadPool pool;
//       infer::Engine engine(model, pool);            // keeps references to model and pool: they outlive it
//       infer::SamplingParams params;
//       params.temperature = 0;
//       params.max_tokens = 32;
//       for (const char* prompt : {"Once upon a time", "The little dog", "Lily and Ben"})
//           engine.add_request(prompt, params);       // queued; returns the request's id
//       while (engine.has_work())                     // each step: one forward pass over every running request
//           for (const infer::Event& event : engine.step())
//               if (event.finished) std::cout << engine.take_result(event.request_id)->text << "\n";
//   }
//
// Dimension letters in shape comments:
//   T tokens in the batch   D model width        H / Hkv query / key-value heads   Dh head size
//   F feed-forward width    L layers             V vocabulary                      B block size (tokens per KV block)
//   N output rows of a matrix, K its input width (a weight is stored [N, K], row-major, as PyTorch's nn.Linear)
//
// Ownership: a Model owns its weights (the mapped files, or the bytes). ForwardPass, Engine and generate() keep
// references to the Model and the ThreadPool they are given, which must outlive them; a Tokenizer is a cheap handle
// to shared, immutable state and may be copied freely.
//
// Configuration: nothing to define. On x86-64 the matrix and attention kernels come in AVX2 and AVX-512 versions
// (appendix F), chosen at run time from CPUID, so no -march flag is needed; elsewhere the portable loops beside
// ForwardPass compute the same sums in the same order (INFER_KERNELS=portable|avx2|avx512 picks one by hand). INFER_CUDA
// (defined by the Meson build when nvcc is found, for the targets that use infer_cuda.cu) declares the CUDA forward
// pass of section 07; without it the header is standard-library-only and --device cuda says so.
//
// Limitations (this version): the header's own kernels are CPU ones (the GPU's live in infer_cuda.cu); weights in
// F32, F16, BF16 or GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and Q2_K-Q6_K blocks (all through integer kernels on 8-bit
// activations; IQ* and TQ* types are refused by name); `infer quantize` writes them all; the KV cache in F32, F16 or
// BF16 (the GPU's in F32); the tokenizer reads BPE tokenizers only
// (tokenizer.json BPE with the components Llama, Mistral, Qwen and GPT-2 use, GGUF "llama"/"gpt2"): WordPiece,
// Unigram and other components are refused by name.
//
// Errors: every failure a user can cause throws infer::Error whose message names the file, field or value;
// infer::fail(parts...) builds and throws one. Expected outcomes (a full KV pool) are return values, not exceptions.
//
// Extending it (an architecture, a weight type, a sampling option, an HTTP endpoint): README.md, "Extending infer".
//
// Standard library only; all functions inline; internals in infer::detail.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <charconv>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define INFER_HAVE_MMAP 1
#endif

// On x86-64 the SIMD kernels are compiled for AVX2 and AVX-512 through target attributes, whatever -march says, and
// chosen at run time from CPUID (section 04, "Which SIMD kernels run").
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define INFER_X86_KERNELS 1
#endif

#define INFER_VERSION_MAJOR 0
#define INFER_VERSION_MINOR 2
#define INFER_VERSION_PATCH 0
#define INFER_VERSION_STRING "0.2.0"  // meson.build reads the three numbers above

namespace infer {

// ==== 01 THE STACK ===================================================================================================
// What every layer shares: one error type whose message is the whole diagnosis, stopwatches for the per-layer times a
// user sees after each request, the JSON value that config files and tokenizers arrive in, and the thread pool the
// forward pass splits its matmuls over. Nothing here is specific to language models, and all of it is cheap next to
// the forward pass, except the thread pool's hand-off, which decode pays a few dozen times per token. (chapter 01)

// The one exception type. Its message is the whole diagnosis: which file, field or value, and what was expected.
struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// concat("tensor ", name, " has ", n, " rows") → one string; fail(...) throws it as an Error. Programs built on the
// header use the same two, so every message is built the same way.
template <class... Parts>
std::string concat(const Parts&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
    throw Error(concat(parts...));
}

namespace detail {

inline bool ends_with(std::string_view text, std::string_view suffix) {
    return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

}  // namespace detail

// ---- Timers ---------------------------------------------------------------------------------------------------------
// Each layer's time is measured where it is spent, so a user can see which one is slow instead of guessing.

class Stopwatch {
public:
    Stopwatch() : start_(std::chrono::steady_clock::now()) {}
    double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
    void restart() { start_ = std::chrono::steady_clock::now(); }

private:
    std::chrono::steady_clock::time_point start_;
};

// Where one request's time went, layer by layer (chapter 01 prints this table).
struct LayerTimes {
    double load = 0, tokenize = 0, prefill = 0, decode = 0, sample = 0, detokenize = 0;
};

// ---- JSON -----------------------------------------------------------------------------------------------------------
// config.json, safetensors headers, tokenizer.json and GGUF-free test references are JSON. A value tree whose lookups
// name the missing field; the strict parser behind Json::parse (errors give the byte offset) is appendix A.

class Json {
public:
    using Array = std::vector<Json>;
    using Object = std::vector<std::pair<std::string, Json>>;  // keeps the file's order

    Json() = default;  // null
    explicit Json(bool value) : value_(value) {}
    explicit Json(double value) : value_(value) {}
    explicit Json(std::string value) : value_(std::move(value)) {}
    explicit Json(Array value) : value_(std::move(value)) {}
    explicit Json(Object value) : value_(std::move(value)) {}

    bool is_null() const { return std::holds_alternative<std::monostate>(value_); }
    bool is_bool() const { return std::holds_alternative<bool>(value_); }
    bool is_number() const { return std::holds_alternative<double>(value_); }
    bool is_string() const { return std::holds_alternative<std::string>(value_); }
    bool is_array() const { return std::holds_alternative<Array>(value_); }
    bool is_object() const { return std::holds_alternative<Object>(value_); }

    bool as_bool() const { return get<bool>("a boolean"); }
    double as_number() const { return get<double>("a number"); }
    const std::string& as_string() const { return get<std::string>("a string"); }
    const Array& as_array() const { return get<Array>("an array"); }
    const Object& as_object() const { return get<Object>("an object"); }
    int64_t as_int() const {
        double number = as_number();
        if (number != std::floor(number) || std::abs(number) > 9007199254740992.0)
            fail("expected an integer, found ", number);
        return static_cast<int64_t>(number);
    }

    // Object member or nullptr.
    const Json* find(std::string_view key) const {
        if (!is_object()) return nullptr;
        for (const auto& [name, value] : std::get<Object>(value_))
            if (name == key) return &value;
        return nullptr;
    }
    const Json& at(std::string_view key) const {
        const Json* member = find(key);
        if (!member) fail("missing field \"", key, "\"");
        return *member;
    }

    static Json parse(std::string_view text, std::string_view origin = "JSON");
    std::string dump() const;  // compact JSON text, members in their order (appendix A)

private:
    template <class T>
    const T& get(const char* expected) const {
        if (const T* value = std::get_if<T>(&value_)) return *value;
        fail("expected ", expected, ", found ", kind_name());
    }
    const char* kind_name() const {
        static constexpr const char* names[] = {"null", "a boolean", "a number", "a string", "an array", "an object"};
        return names[value_.index()];
    }
    std::variant<std::monostate, bool, double, std::string, Array, Object> value_;
};

// `text` as a JSON string literal, quotes included (appendix A). Invalid UTF-8 is written as U+FFFD.
inline void write_json_string(std::ostream& out, std::string_view text);

// ---- Cache-line-aligned buffers -------------------------------------------------------------------------------------
// A SIMD load that straddles two cache lines costs two: a matmul whose activation rows start 16 bytes past a line
// boundary runs at half speed (chapter 07 measures it). Activations, scratch and the KV cache therefore start on
// 64-byte boundaries.
inline constexpr std::align_val_t cache_line{64};

template <class T>
struct CacheLineAllocator {
    using value_type = T;
    CacheLineAllocator() = default;
    template <class U>
    CacheLineAllocator(const CacheLineAllocator<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), cache_line)); }
    void deallocate(T* p, size_t) { ::operator delete(p, cache_line); }
    bool operator==(const CacheLineAllocator&) const = default;
};
template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// For arrays that are left uninitialized (the KV cache): allocate with ::operator new[](bytes, cache_line).
struct CacheLineDelete {
    void operator()(float* p) const { ::operator delete[](p, cache_line); }
    void operator()(std::byte* p) const { ::operator delete[](p, cache_line); }
};

// ---- Thread pool ----------------------------------------------------------------------------------------------------
// A matmul's rows are split into one contiguous range per thread (or, for prefill-sized batches, into pieces the
// threads claim as they go); the caller runs the first range itself. Decode runs
// a few parallel sections per layer, each a fraction of a millisecond, so the hand-off must cost microseconds, not the
// tens of microseconds a sleeping thread takes to wake: workers spin briefly between sections, then sleep (appendix B
// has the mechanics). Chapter 07 measures what the cores can do; chapter 01 shows how often decode pays the hand-off.

class ThreadPool {
public:
    explicit ThreadPool(int threads = 0);  // 0 threads: one per hardware thread
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;
    ~ThreadPool();

    int size() const { return size_; }

    // Calls body(begin, end, thread) on `size()` disjoint ranges that cover [0, count) and returns when all are done.
    // One caller at a time: the engine's loop owns its pool.
    template <class Body>
    void run(size_t count, Body&& body) {
        if (size_ == 1 || count <= 1) {
            body(size_t{0}, count, 0);
            return;
        }
        auto call = [](void* context, size_t begin, size_t end, int thread) {
            (*static_cast<std::remove_reference_t<Body>*>(context))(begin, end, thread);
        };
        run_job(call, &body, count);
    }

    // Like run(), but on the calling thread alone when the job is smaller than a hand-off costs: `work` counts its
    // multiply-adds (or steps of similar cost). Tiny models and short sections then never wait for another thread,
    // which matters most when the machine has more runnable threads than cores.
    template <class Body>
    void run_sized(size_t count, size_t work, Body&& body) {
        if (work < min_parallel_work) body(size_t{0}, count, 0);
        else run(count, body);
    }

    // Like run_sized(), but [0, count) is cut into pieces of `piece` (the last one shorter) that the threads claim one
    // after another, each calling body(begin, end, thread) once per piece it claims. Fixed equal shares finish
    // together only while every core runs at the same speed; on a machine where other work takes a core for a while
    // (a shared host, another program), its thread claims fewer pieces instead of keeping the others waiting.
    template <class Body>
    void run_claimed(size_t count, size_t piece, size_t work, Body&& body) {
        if (work < min_parallel_work) return body(size_t{0}, count, 0);
        piece = std::max<size_t>(piece, 1);
        std::atomic<size_t> next{0};
        run(static_cast<size_t>(size_), [&](size_t, size_t, int thread) {
            for (size_t begin; (begin = next.fetch_add(piece)) < count;) body(begin, std::min(count, begin + piece), thread);
        });
    }
    static constexpr size_t min_parallel_work = size_t{1} << 16;

private:
    using Job = void (*)(void* context, size_t begin, size_t end, int thread);
    void run_job(Job job, void* context, size_t count);  // wake the workers, run share 0, wait for the rest
    void run_share(int thread);
    void worker_loop(int thread);
    static constexpr std::chrono::microseconds spin_budget{200};

    int size_ = 1;
    std::vector<std::thread> workers_;
    // Each counter on its own cache line: workers poll one while the caller polls the other.
    alignas(64) std::atomic<uint64_t> generation_{0};
    alignas(64) std::atomic<int> pending_{0};
    std::atomic<bool> stopping_{false};
    Job job_ = nullptr;
    void* context_ = nullptr;
    size_t count_ = 0;
};

// ==== 02 WEIGHTS ON DISK =============================================================================================
// Three formats become one Model. A Hugging Face folder (config.json + safetensors), a GGUF file and a llama2.c .bin
// hold the same matrices under different names and layouts. Tensors stay in their stored dtype inside the mapped file
// (no copy): loading costs a header parse, and resident memory is what decode touches. Every shape is checked once
// here, so the forward pass can trust them. Chapter 02 checks the footprint arithmetic (parameters × bytes per
// parameter) against the file sizes.

// A read-only view of a whole file. Where the OS allows, the file is mapped, not read: loading a multi-gigabyte
// checkpoint then costs page-table setup, and each weight is paged in from the page cache the first time a matmul
// touches it. The price: a mapped file that is truncated or rewritten in place while in use takes the process down
// (SIGBUS) at the next touch of a vanished page. FileAccess::Read copies the bytes into memory instead (in 2 MB pages
// where Linux allows), which a long-running server may prefer (`infer serve --no-mmap`); it is also the only way where
// mmap is missing.
enum class FileAccess { Map, Read };

class MappedFile {
public:
    MappedFile() = default;
    explicit MappedFile(const std::filesystem::path& path, FileAccess access = FileAccess::Map);  // appendix B
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;
    ~MappedFile();

    const std::byte* data() const { return data_; }
    size_t size() const { return size_; }
    const std::string& path() const { return path_; }

private:
    std::string path_;
    const std::byte* data_ = nullptr;
    size_t size_ = 0;
    std::unique_ptr<std::byte[]> copy_;  // holds the bytes, when read rather than mapped (data_: where they start)
};

inline std::string read_text_file(const std::filesystem::path& path);  // a whole file as text (config.json, ...)

// ---- 16-bit floats --------------------------------------------------------------------------------------------------
// bf16 is the top half of an f32 (same exponent range, 8 mantissa bits): widening is a shift. f16 has 5 exponent bits,
// so widening rebuilds the exponent. Checkpoints store weights this way to halve the bytes a decode step must read.
// The f16 conversions and the rounding directions are appendix B.

inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
inline uint16_t f32_to_bf16(float value);  // round to nearest even, NaN stays NaN
inline float f16_to_f32(uint16_t half);
inline uint16_t f32_to_f16(float value);

// ---- Tensors and the Model ------------------------------------------------------------------------------------------

// A weight's number format. Each is described by its block: `elements` weights stored in `bytes` bytes. Plain floats
// are blocks of one; a block-quantized type fits the same description, so every footprint, row size and file-size
// check below is computed one way, from this table. GGUF's quantized blocks keep small integers plus a scale per
// block: Q8_0 stores 32 weights as int8 and one f16 scale d (34 bytes, 8.5 bits a weight), w = d·q; Q4_0 the same with
// 4-bit q (18 bytes, 4.5 bits). The K-quants group 256 weights in sub-blocks whose own 6- or 8-bit scales are scaled
// again by the block's f16 d: Q4_K keeps 8 sub-blocks of 32 with a scale and a minimum each, w = (d·sc)·q − (dmin·m)
// (144 bytes, 4.5 bits). A "Q4_K_M" file mixes types tensor by tensor. Decoding each layout: appendix H.
enum class DType { F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K };

// One row per type, in DType's order: what every layer asks of a weight type. The loaders read its block shape and
// GGUF id; the matmul (appendix F) takes the integer path where activation_block is set, the decode-to-f32 path for
// any other block type; loading interleaves row groups where row_groups is set (appendix H); infer_cuda.cu keeps the
// weights as stored on the GPU where on_gpu is set, and widens the others to f32 at upload.
struct DTypeBlock {
    const char* name;      // as safetensors and GGUF spell it
    int elements;          // weights per block
    int bytes;             // bytes per block
    int gguf_type;         // the type id in a GGUF tensor table
    int activation_block;  // the integer kernel multiplies 8-bit activations in blocks of this many; 0: no such kernel
    bool row_groups;       // its rows are summed in one chain, so a matrix can be kept sixteen rows interleaved
    bool on_gpu;           // the GPU's kernels read it as stored
};

inline constexpr DTypeBlock dtype_blocks[] = {
    // name    elements bytes gguf  activations row groups on GPU
    {"F32",    1,       4,    0,    0,          false,     true},
    {"F16",    1,       2,    1,    0,          false,     false},
    {"BF16",   1,       2,    30,   0,          false,     true},
    {"Q8_0",   32,      34,   8,    32,         true,      true},
    {"Q4_0",   32,      18,   2,    32,         true,      false},
    {"Q4_1",   32,      20,   3,    32,         false,     false},
    {"Q5_0",   32,      22,   6,    32,         false,     false},
    {"Q5_1",   32,      24,   7,    32,         false,     false},
    {"Q2_K",   256,     84,   10,   256,        false,     false},
    {"Q3_K",   256,     110,  11,   256,        false,     false},
    {"Q4_K",   256,     144,  12,   256,        true,      true},
    {"Q5_K",   256,     176,  13,   256,        false,     false},
    {"Q6_K",   256,     210,  14,   256,        true,      false},
};

constexpr const DTypeBlock& dtype_block(DType dtype) {
    const auto index = static_cast<size_t>(dtype);
    if (index >= std::size(dtype_blocks)) fail("weight type ", index, " is not one of the ", std::size(dtype_blocks), " types");
    return dtype_blocks[index];
}
inline constexpr int dtype_count = static_cast<int>(std::size(dtype_blocks));
inline bool is_quantized(DType dtype) { return dtype_block(dtype).elements > 1; }

// `count` weights of a row of blocks widened to f32 (count a multiple of the block): the plain decoders of appendix H.
inline void dequantize_row(DType dtype, const std::byte* blocks, float* out, int64_t count);
inline const char* dtype_name(DType dtype) { return dtype_block(dtype).name; }

// Bytes of `count` consecutive weights: a whole number of blocks (the loaders check that every row is).
inline uint64_t dtype_bytes(DType dtype, int64_t count) {
    const DTypeBlock& block = dtype_block(dtype);
    return static_cast<uint64_t>(count / block.elements) * static_cast<uint64_t>(block.bytes);
}

// A view of a weight matrix or vector inside a mapped file (or a buffer the Model owns). Shapes are row-major,
// outermost first, as PyTorch writes them: a linear layer's weight is [N, K].
struct Tensor {
    std::string name;                // as the file names it, for messages
    DType dtype = DType::F32;        // the stored type: the forward pass converts in registers, never in memory
    std::vector<int64_t> shape;      // outermost first: [N, K] for a matrix
    const std::byte* data = nullptr; // into the mapping: no copy, so loading costs no time per weight
    // Q8_0, Q4_0, Q4_K and Q6_K matrices of a loaded Model: the same blocks interleaved sixteen rows at a time, the
    // layout the CPU's integer kernels read fastest (appendix H); null elsewhere, and the kernels interleave on the fly.
    const std::byte* row_groups = nullptr;

    bool empty() const { return data == nullptr; }
    int64_t elements() const {
        return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
    }
    size_t bytes() const { return static_cast<size_t>(dtype_bytes(dtype, elements())); }
    int64_t rows() const { return shape.empty() ? 0 : shape.front(); }
    int64_t cols() const { return shape.empty() ? 0 : shape.back(); }
    // Element i of a 1-D tensor (norm gains, biases), widened to f32.
    float at(int64_t i) const {
        uint16_t half;
        switch (dtype) {
            case DType::F32: {
                float value;
                std::memcpy(&value, data + i * 4, 4);
                return value;
            }
            case DType::BF16: std::memcpy(&half, data + i * 2, 2); return bf16_to_f32(half);
            case DType::F16: std::memcpy(&half, data + i * 2, 2); return f16_to_f32(half);
            default: {  // a quantized tensor: decode the block that holds element i
                const DTypeBlock& block = dtype_block(dtype);
                float values[256];
                dequantize_row(dtype, data + i / block.elements * block.bytes, values, block.elements);
                return values[i % block.elements];
            }
        }
    }
    // Row r of a 2-D tensor widened into `out`: the embedding lookup, the only place a whole row is converted.
    void read_row(int64_t r, float* out) const {
        int64_t width = cols();
        if (is_quantized(dtype)) return dequantize_row(dtype, data + r * static_cast<int64_t>(dtype_bytes(dtype, width)), out, width);
        for (int64_t i = 0; i < width; ++i) out[i] = at(r * width + i);
    }
};

namespace detail {
// The number of elements a shape from a file describes, refusing negative dimensions and products past 2^60, so
// that neither the count nor its bytes (at most 4 per element) can wrap. The product of the non-zero dimensions is
// what is bounded: a zero anywhere makes the count 0, but Tensor::elements() multiplies in another order and must
// not overflow on the way there.
inline int64_t checked_element_count(const std::vector<int64_t>& shape, std::string_view where) {
    constexpr int64_t limit = int64_t{1} << 60;
    int64_t nonzero_product = 1;
    bool has_zero = false;
    for (int64_t dim : shape) {
        if (dim < 0) fail(where, ": negative dimension ", dim);
        if (dim == 0) {
            has_zero = true;
            continue;
        }
        if (nonzero_product > limit / dim) fail(where, ": the shape's element count exceeds 2^60");
        nonzero_product *= dim;
    }
    return has_zero ? 0 : nonzero_product;
}
}  // namespace detail

// "[2048, 768]": shapes in messages read as PyTorch prints them.
inline std::string shape_string(const std::vector<int64_t>& shape) {
    std::string text = "[";
    for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
    return text + "]";
}

// ---- Architectures --------------------------------------------------------------------------------------------------
// The one list of what the loaders accept. The Llama family differs in a few switches, each explained where the
// forward pass uses it (section 04): Qwen2 adds biases to q, k and v; Qwen3 normalizes each head of q and k before
// RoPE; Mistral always slides its attention window. Adding a member of the family is a row here (plus, where its files
// name tensors differently, an entry in the loaders' name tables); README.md's "Extending infer" walks through it.

struct Architecture {
    const char* name;      // config.json's model_type, GGUF's general.architecture
    bool qkv_bias;         // q, k, v projections carry biases
    bool qk_norm;          // RMSNorm over each head of q and k before RoPE
    bool always_windowed;  // config.json's sliding_window always applies (else only with use_sliding_window true)
    bool in_gguf;          // llama.cpp writes GGUF files under this name (its converter writes Mistral as "llama")
    bool gguf_rope_pairs;  // its GGUF files keep Meta's q/k row order: RoPE rotates adjacent pairs (see RopeStyle)
};

inline constexpr Architecture architectures[] = {
    //  name      qkv_bias qk_norm windowed in_gguf rope_pairs
    {"llama",     false,   false,  false,   true,   true},
    {"mistral",   false,   false,  true,    false,  false},
    {"qwen2",     true,    false,  false,   true,   false},
    {"qwen3",     false,   true,   false,   true,   false},
};

// The row for `name` (as a Hugging Face config or, with `gguf`, a GGUF file spells it), or nullptr.
inline const Architecture* find_architecture(std::string_view name, bool gguf) {
    for (const Architecture& a : architectures)
        if (name == a.name && (!gguf || a.in_gguf)) return &a;
    return nullptr;
}

// "llama, mistral, qwen2, qwen3": for the message that refuses anything else.
inline std::string architecture_names(bool gguf) {
    std::string names;
    for (const Architecture& a : architectures)
        if (!gguf || a.in_gguf) names += (names.empty() ? "" : ", ") + std::string(a.name);
    return names;
}

// How RoPE pairs the dimensions of a head. Hugging Face checkpoints rotate dimension i with i + Dh/2 ("rotate half",
// GPT-NeoX style). Meta's original checkpoints, llama2.c and GGUF "llama" files rotate adjacent pairs (2i, 2i+1): the
// converter permutes the q/k rows. Both give the same attention scores, so we follow the file instead of permuting.
enum class RopeStyle { HalfRotation, AdjacentPairs };

// Long-context RoPE scaling (config.json's rope_scaling): Llama 3.1 stretches the long wavelengths, "linear" all of
// them. rope_frequency_divisors() below says what each frequency is divided by; section 04 applies it.
struct RopeScaling {
    enum class Kind { None, Linear, Llama3 } kind = Kind::None;
    double factor = 1, low_freq_factor = 1, high_freq_factor = 4, original_context = 8192;
};

// The hyperparameters every loader fills in, whatever the file calls them. Section 04 explains each switch where the
// forward pass uses it.
struct ModelConfig {
    std::string architecture;  // a name from `architectures`
    int dim = 0;               // D
    int n_layers = 0;          // L
    int n_heads = 0;           // H
    int n_kv_heads = 0;        // Hkv: grouped-query attention shares one K/V head among H / Hkv query heads
    int head_dim = 0;          // Dh (qwen3: H × Dh may differ from D)
    int ffn_dim = 0;           // F
    int vocab_size = 0;        // V
    int context_length = 0;    // positions it runs at: the file's; a caller may lower it (llama.cpp's -c) to bound
                               // prompt + output and the KV cache
    double rope_theta = 10000;   // RoPE's base: dimension pair i turns by position · theta^(-2i/Dh)
    double norm_eps = 1e-5;      // RMSNorm's epsilon, from the file: it changes the logits at the 1e-4 level
    int sliding_window = 0;  // attend to at most this many latest positions (Mistral); 0: the whole prefix
    RopeStyle rope_style = RopeStyle::HalfRotation;
    RopeScaling rope_scaling;
    bool qkv_bias = false;  // qwen2
    bool qk_norm = false;   // qwen3: RMSNorm over each head of q and k before RoPE
    bool tied_embeddings = false;  // the classifier is the embedding matrix (small models save V × D weights)
    int bos_id = -1;               // -1: the model has none
    std::vector<int> eos_ids;      // generation stops at any of them (the tokenizer may add more)
};

namespace detail {
// What each RoPE frequency is divided by under the config's scaling: 1 without, `factor` for linear; Llama 3
// stretches long wavelengths by `factor`, keeps short ones, and blends the band between smoothly. (GGUF files carry
// Llama 3's divisors as the rope_freqs tensor.)
inline std::vector<double> rope_frequency_divisors(const ModelConfig& c) {
    const int half = c.head_dim / 2;
    const RopeScaling& s = c.rope_scaling;
    std::vector<double> divisors(static_cast<size_t>(half), 1.0);
    for (int i = 0; i < half; ++i) {
        const double freq = 1.0 / std::pow(c.rope_theta, 2.0 * i / c.head_dim);
        if (s.kind == RopeScaling::Kind::Linear) {
            divisors[i] = s.factor;
        } else if (s.kind == RopeScaling::Kind::Llama3) {
            const double wavelength = 2 * M_PI / freq;
            const double low_wavelength = s.original_context / s.low_freq_factor;
            const double high_wavelength = s.original_context / s.high_freq_factor;
            if (wavelength > low_wavelength) {
                divisors[i] = s.factor;
            } else if (wavelength >= high_wavelength) {
                const double smooth = (s.original_context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                divisors[i] = 1 / ((1 - smooth) / s.factor + smooth);
            }
        }
    }
    return divisors;
}
}  // namespace detail

struct LayerWeights {
    Tensor attn_norm;         // [D]
    Tensor wq, wk, wv, wo;    // [H·Dh, D], [Hkv·Dh, D], [Hkv·Dh, D], [D, H·Dh]
    Tensor bq, bk, bv;        // [H·Dh], [Hkv·Dh], [Hkv·Dh] (qwen2), else empty
    Tensor q_norm, k_norm;    // [Dh] (qwen3), else empty
    Tensor ffn_norm;          // [D]
    Tensor w_gate, w_up;      // [F, D]
    Tensor w_down;            // [D, F]

    // Every tensor of the layer (the optional ones may be empty), for footprint arithmetic. A new tensor kind is a
    // member above and an entry here; the loaders' name tables say what each format calls it.
    std::vector<const Tensor*> tensors() const {
        return {&attn_norm, &wq, &wk, &wv, &wo, &bq, &bk, &bv, &q_norm, &k_norm, &ffn_norm, &w_gate, &w_up, &w_down};
    }
    std::vector<Tensor*> tensors() {  // the same list, to change them (the CPU's row groups)
        std::vector<Tensor*> all;
        for (const Tensor* t : std::as_const(*this).tensors()) all.push_back(const_cast<Tensor*>(t));
        return all;
    }
};

// The vocabulary as llama2.c and GGUF files carry it: SentencePiece pieces with merge scores ("llama"), or byte-level
// BPE tokens with ranked merges ("gpt2"). The tokenizer section turns it into a Tokenizer; a Hugging Face folder keeps
// its tokenizer in tokenizer.json instead, which the tokenizer section reads itself.
struct Vocabulary {
    enum class Type : int32_t { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };
    enum class Model { Scores, RankedMerges, Unsupported };  // GGUF tokenizer.ggml.model "llama", "gpt2", anything else
    Model model = Model::Scores;
    std::string model_name = "llama"; // tokenizer.ggml.model as the file spells it, for messages ("" when absent)
    std::vector<std::string> pieces;  // "▁the", "<0x0A>", "<s>" … ("Ġthe" in gpt2 vocabularies)
    std::vector<float> scores;        // llama: higher merges first
    std::vector<std::string> merges;  // gpt2: "left right", the first merges first
    std::string pre;                  // gpt2: tokenizer.ggml.pre, which names the split regex ("llama-bpe", "qwen2")
    std::vector<Type> types;          // Control pieces decode to nothing; Byte pieces to their byte
    int unk_id = 0;                   // what a character without a piece or byte token becomes
    bool add_bos = true;              // encode() starts the ids with BOS (Llama 2) or not (GPT-2, Qwen)
    bool add_eos = false;
    bool add_space_prefix = true;  // SentencePiece's add_dummy_prefix: " " + text
    std::string chat_template;     // GGUF tokenizer.chat_template, "" when none
    bool empty() const { return pieces.empty(); }
};

enum class ModelFormat { HuggingFace, Gguf, Llama2c, BuiltIn };

// "safetensors", "gguf", "llama2.c", "built-in": how the format is named in messages and reports.
inline const char* format_name(ModelFormat format) {
    switch (format) {
        case ModelFormat::HuggingFace: return "safetensors";
        case ModelFormat::Gguf: return "gguf";
        case ModelFormat::Llama2c: return "llama2.c";
        case ModelFormat::BuiltIn: return "built-in";
    }
    return "?";
}

namespace detail {
struct TokenizerSlot;  // section 04: the tokenizer tokenizer_for() builds once per Model
inline std::shared_ptr<TokenizerSlot> new_tokenizer_slot();
}  // namespace detail

// The weights and everything the forward pass needs to know about them. Tensors point into `files` (mapped) or
// `owned` (built in): the Model owns both, and everything built from it keeps a reference, so it must outlive them.
struct Model {
    ModelConfig config;
    Tensor embedding;   // [V, D]
    Tensor final_norm;  // [D]
    Tensor lm_head;     // [V, D]; the embedding itself when tied
    std::vector<LayerWeights> layers;
    std::vector<float> rope_freq_divisors;  // [Dh/2] GGUF rope_freqs (llama3 scaling precomputed), else empty
    Vocabulary vocab;                       // empty for a Hugging Face folder (its tokenizer.json: load_tokenizer)
    std::string source;                     // the path it came from, for messages
    ModelFormat format = ModelFormat::BuiltIn;

    std::vector<std::shared_ptr<MappedFile>> files;  // keep the mappings alive (shared: a GgufFile may hold one too)
    std::vector<std::vector<std::byte>> owned;       // or own the bytes (built-in models)
    std::unique_ptr<std::byte[]> row_group_storage;  // the Tensors' row_groups (appendix H), else null
    // Its tokenizer, built by the first tokenizer_for() and handed out from then on: reading a tokenizer.json takes
    // 0.2-0.7 s, too much to pay on every generate(). Shared, so a moved Model keeps it.
    std::shared_ptr<detail::TokenizerSlot> tokenizer_slot = detail::new_tokenizer_slot();

    // Tensors point into `files` or `owned`: a copy would point into the original's buffers, so a Model only moves.
    Model() = default;
    Model(Model&&) = default;
    Model& operator=(Model&&) = default;
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;

    // Bytes of weights one decode step reads: every matrix once (the embedding only one row, unless it is the head).
    size_t weight_bytes_per_token() const {
        size_t total = final_norm.bytes() + lm_head.bytes() + static_cast<size_t>(dtype_bytes(embedding.dtype, embedding.cols()));
        for (const auto& layer : layers)
            for (const Tensor* t : layer.tensors())
                if (!t->empty()) total += t->bytes();
        return total;
    }
    // Parameters as a model card counts them: a tied classifier once.
    int64_t parameter_count() const {
        int64_t total = embedding.elements() + final_norm.elements() + (config.tied_embeddings ? 0 : lm_head.elements());
        for (const auto& layer : layers)
            for (const Tensor* t : layer.tensors())
                if (!t->empty()) total += t->elements();
        return total;
    }
};

namespace detail {

// Every tensor a Model needs, checked for presence and shape, so the forward pass can trust them.
inline void check_shape(const Tensor& tensor, const std::vector<int64_t>& expected, const std::string& source) {
    if (tensor.shape != expected)
        fail(source, ": tensor ", tensor.name, " has shape ", shape_string(tensor.shape), ", expected ",
             shape_string(expected));
}

// Hyperparameters that would make the forward pass divide by zero or index out of range are refused here, with the
// field's name, instead of failing later as a crash.
inline void validate_config(const ModelConfig& c, const std::string& source) {
    auto positive = [&](int value, const char* field) {
        if (value <= 0) fail(source, ": ", field, " must be positive, found ", value);
    };
    positive(c.dim, "hidden size");
    positive(c.n_layers, "number of layers");
    positive(c.n_heads, "number of attention heads");
    positive(c.n_kv_heads, "number of key-value heads");
    positive(c.head_dim, "head dimension");
    positive(c.ffn_dim, "intermediate (ffn) size");
    positive(c.vocab_size, "vocabulary size");
    positive(c.context_length, "context length");
    if (c.n_heads % c.n_kv_heads != 0)
        fail(source, ": ", c.n_heads, " attention heads are not a multiple of ", c.n_kv_heads, " key-value heads");
    if (c.head_dim % 2 != 0) fail(source, ": head dimension ", c.head_dim, " is odd; RoPE needs pairs");
    if (!(c.norm_eps > 0)) fail(source, ": rms_norm_eps must be positive, found ", c.norm_eps);
    if (!(c.rope_theta > 0)) fail(source, ": rope_theta must be positive, found ", c.rope_theta);
}

// The one check between the files and the forward pass: every tensor present with the shape the config implies.
inline void validate_model(const Model& m) {
    const ModelConfig& c = m.config;
    validate_config(c, m.source);
    const int64_t D = c.dim, F = c.ffn_dim, V = c.vocab_size, Dh = c.head_dim;
    const int64_t q_width = int64_t{c.n_heads} * Dh, kv_width = int64_t{c.n_kv_heads} * Dh;
    check_shape(m.embedding, {V, D}, m.source);
    check_shape(m.lm_head, {V, D}, m.source);
    check_shape(m.final_norm, {D}, m.source);
    if (static_cast<int>(m.layers.size()) != c.n_layers) fail(m.source, ": expected ", c.n_layers, " layers");
    for (const auto& layer : m.layers) {
        check_shape(layer.attn_norm, {D}, m.source);
        check_shape(layer.wq, {q_width, D}, m.source);
        check_shape(layer.wk, {kv_width, D}, m.source);
        check_shape(layer.wv, {kv_width, D}, m.source);
        check_shape(layer.wo, {D, q_width}, m.source);
        if (c.qkv_bias) {
            check_shape(layer.bq, {q_width}, m.source);
            check_shape(layer.bk, {kv_width}, m.source);
            check_shape(layer.bv, {kv_width}, m.source);
        }
        if (c.qk_norm) {
            check_shape(layer.q_norm, {Dh}, m.source);
            check_shape(layer.k_norm, {Dh}, m.source);
        }
        check_shape(layer.ffn_norm, {D}, m.source);
        check_shape(layer.w_gate, {F, D}, m.source);
        check_shape(layer.w_up, {F, D}, m.source);
        check_shape(layer.w_down, {D, F}, m.source);
    }
    if (!m.rope_freq_divisors.empty() && static_cast<int64_t>(m.rope_freq_divisors.size()) != Dh / 2)
        fail(m.source, ": rope_freqs has ", m.rope_freq_divisors.size(), " entries, expected ", Dh / 2);
    if (!m.vocab.empty() && static_cast<int>(m.vocab.pieces.size()) != c.vocab_size)
        fail(m.source, ": the vocabulary has ", m.vocab.pieces.size(), " tokens but the model's embedding has ",
             c.vocab_size, " rows");
}

// The Q8_0, Q4_0, Q4_K and Q6_K matrices interleaved for the CPU's integer kernels, beside the mapping (appendix H).
inline void add_row_groups(Model& model);

// Reads fields of config.json with messages that name the file and the field.
class ConfigReader {
    template <class Get>
    auto checked(std::string_view key, Get get) const -> decltype(get()) {
        try {
            return get();
        } catch (const Error& e) {
            fail(file_, ": field \"", key, "\": ", e.what());
        }
    }

public:
    ConfigReader(const Json& json, std::string file) : json_(json), file_(std::move(file)) {}

    const Json* find(std::string_view key) const {
        const Json* value = json_.find(key);
        return value && !value->is_null() ? value : nullptr;
    }
    int64_t integer(std::string_view key) const {
        const Json* value = find(key);
        if (!value) fail(file_, ": missing field \"", key, "\"");
        return checked(key, [&] { return value->as_int(); });
    }
    int64_t integer_or(std::string_view key, int64_t fallback) const { return find(key) ? integer(key) : fallback; }
    double number_or(std::string_view key, double fallback) const {
        const Json* value = find(key);
        return value ? checked(key, [&] { return value->as_number(); }) : fallback;
    }
    bool boolean_or(std::string_view key, bool fallback) const {
        const Json* value = find(key);
        return value ? checked(key, [&] { return value->as_bool(); }) : fallback;
    }
    std::string string(std::string_view key) const {
        const Json* value = find(key);
        if (!value) fail(file_, ": missing field \"", key, "\"");
        return checked(key, [&] { return value->as_string(); });
    }
    const std::string& file() const { return file_; }

private:
    const Json& json_;
    std::string file_;
};

inline ModelConfig config_from_hugging_face(const Json& json, const std::string& file) {
    ConfigReader read(json, file);
    ModelConfig c;
    c.architecture = read.string("model_type");
    const Architecture* arch = find_architecture(c.architecture, false);
    if (!arch)
        fail(file, ": unsupported model_type \"", c.architecture, "\" (supported: ", architecture_names(false), ")");
    if (const Json* act = read.find("hidden_act"); act && act->is_string() && act->as_string() != "silu")
        fail(file, ": unsupported hidden_act \"", act->as_string(), "\" (only silu)");
    // Hugging Face's names for the shape; a missing optional field takes the default transformers itself uses.
    c.dim = static_cast<int>(read.integer("hidden_size"));
    c.n_layers = static_cast<int>(read.integer("num_hidden_layers"));
    c.n_heads = static_cast<int>(read.integer("num_attention_heads"));
    c.n_kv_heads = static_cast<int>(read.integer_or("num_key_value_heads", c.n_heads));  // absent: no GQA
    c.ffn_dim = static_cast<int>(read.integer("intermediate_size"));
    c.vocab_size = static_cast<int>(read.integer("vocab_size"));
    c.context_length = static_cast<int>(read.integer_or("max_position_embeddings", 2048));
    if (c.n_heads <= 0) fail(file, ": num_attention_heads must be positive, found ", c.n_heads);
    c.head_dim = static_cast<int>(read.integer_or("head_dim", c.dim / c.n_heads));  // Qwen3 sets it apart from D / H
    c.rope_theta = read.number_or("rope_theta", 10000.0);
    c.norm_eps = read.number_or("rms_norm_eps", 1e-6);
    c.tied_embeddings = read.boolean_or("tie_word_embeddings", false);
    c.rope_style = RopeStyle::HalfRotation;  // transformers' checkpoints: rotate_half
    c.qkv_bias = arch->qkv_bias || read.boolean_or("attention_bias", false);
    c.qk_norm = arch->qk_norm;
    if (read.boolean_or("mlp_bias", false)) fail(file, ": mlp_bias true is not supported");
    // Mistral applies its window always; Qwen2 only with use_sliding_window (its configs set the size regardless).
    if (arch->always_windowed || read.boolean_or("use_sliding_window", false))
        c.sliding_window = static_cast<int>(read.integer_or("sliding_window", 0));

    if (const Json* scaling = read.find("rope_scaling")) {
        ConfigReader rope(*scaling, file + " rope_scaling");
        std::string type = rope.find("rope_type") ? rope.string("rope_type") : rope.string("type");
        if (type == "llama3") {
            c.rope_scaling.kind = RopeScaling::Kind::Llama3;
            c.rope_scaling.factor = rope.number_or("factor", 8);
            c.rope_scaling.low_freq_factor = rope.number_or("low_freq_factor", 1);
            c.rope_scaling.high_freq_factor = rope.number_or("high_freq_factor", 4);
            c.rope_scaling.original_context = rope.number_or("original_max_position_embeddings", 8192);
        } else if (type == "linear") {
            c.rope_scaling.kind = RopeScaling::Kind::Linear;
            c.rope_scaling.factor = rope.number_or("factor", 1);
        } else if (type != "default") {
            fail(file, ": unsupported rope_scaling type \"", type, "\" (supported: llama3, linear)");
        }
        if (!(c.rope_scaling.factor > 0)) fail(file, ": rope_scaling factor must be positive");
    }
    if (const Json* bos = read.find("bos_token_id"); bos && bos->is_number()) c.bos_id = static_cast<int>(bos->as_int());
    if (const Json* eos = read.find("eos_token_id")) {
        if (eos->is_number()) c.eos_ids.push_back(static_cast<int>(eos->as_int()));
        else if (eos->is_array())
            for (const Json& id : eos->as_array()) c.eos_ids.push_back(static_cast<int>(id.as_int()));
    }
    return c;
}

}  // namespace detail

// ---- safetensors ----------------------------------------------------------------------------------------------------
// Layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then
// the raw tensor bytes. data_offsets count from the end of the header. Everything is checked against the file size.

namespace detail {

inline uint64_t read_u64_le(const std::byte* p) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(p[i]);
    return value;
}

// The tensor table of one safetensors file: each entry a view into the mapping, every offset checked first.
inline std::unordered_map<std::string, Tensor> read_safetensors(const MappedFile& file) {
    const std::string& path = file.path();
    if (file.size() < 8) fail(path, ": truncated safetensors file (", file.size(), " bytes, no header length)");
    uint64_t header_length = read_u64_le(file.data());
    if (header_length > file.size() - 8)
        fail(path, ": safetensors header length ", header_length, " runs past the end of the file (", file.size(),
             " bytes)");
    std::string_view header_text(reinterpret_cast<const char*>(file.data() + 8), header_length);
    Json header = Json::parse(header_text, path + " (safetensors header)");
    if (!header.is_object()) fail(path, ": safetensors header is not a JSON object");
    const std::byte* body = file.data() + 8 + header_length;  // offsets count from here
    const uint64_t body_size = file.size() - 8 - header_length;

    std::unordered_map<std::string, Tensor> tensors;
    for (const auto& [name, info] : header.as_object()) {
        if (name == "__metadata__") continue;  // free-form strings ({"format": "pt"}), not a tensor
        try {
            Tensor tensor;
            tensor.name = name;
            // safetensors spells dtypes as we do; the quantized types exist only in GGUF.
            const std::string& dtype = info.at("dtype").as_string();
            if (dtype == "F32") tensor.dtype = DType::F32;
            else if (dtype == "BF16") tensor.dtype = DType::BF16;
            else if (dtype == "F16") tensor.dtype = DType::F16;
            else fail("unsupported dtype ", dtype, " (supported: F32, BF16, F16)");
            for (const Json& dim : info.at("shape").as_array()) tensor.shape.push_back(dim.as_int());
            detail::checked_element_count(tensor.shape, "shape");
            const auto& offsets = info.at("data_offsets").as_array();
            if (offsets.size() != 2) fail("data_offsets must have two entries");
            int64_t begin = offsets[0].as_int(), end = offsets[1].as_int();
            if (begin < 0 || end < begin || static_cast<uint64_t>(end) > body_size)
                fail("data_offsets [", begin, ", ", end, "] run past the end of the file (data section is ", body_size,
                     " bytes; the file may be truncated)");
            // The one check that catches a wrong shape, a wrong dtype and a corrupt table alike.
            if (static_cast<uint64_t>(end - begin) != tensor.bytes())
                fail("data_offsets cover ", end - begin, " bytes but shape ", shape_string(tensor.shape), " in ", dtype,
                     " needs ", tensor.bytes());
            tensor.data = body + begin;
            tensors.emplace(name, std::move(tensor));
        } catch (const Error& e) {  // every message names the file and the tensor, once
            std::string message = e.what();
            if (message.rfind(path, 0) == 0) throw;
            fail(path, ": tensor ", name, ": ", message);
        }
    }
    return tensors;
}

}  // namespace detail

namespace detail {

// What each format calls the tensors of a Llama-family model. Layer names are "<prefix><i>.<name>".
struct TensorNames {
    const char *embedding, *final_norm, *lm_head, *layer_prefix;
    const char *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *q_norm, *k_norm, *ffn_norm, *w_gate, *w_up, *w_down;
};

inline constexpr TensorNames hugging_face_names{
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.",
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight"};

inline constexpr TensorNames gguf_names{
    "token_embd.weight", "output_norm.weight", "output.weight", "blk.",
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q.bias",
    "attn_k.bias", "attn_v.bias", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight",
    "ffn_up.weight", "ffn_down.weight"};

// The per-layer names, in the order of LayerWeights::tensors().
inline std::array<const char*, 14> layer_tensor_names(const TensorNames& n) {
    return {n.attn_norm, n.wq, n.wk, n.wv, n.wo, n.bq, n.bk, n.bv, n.q_norm, n.k_norm, n.ffn_norm, n.w_gate, n.w_up, n.w_down};
}

// A tensor's name in one format spelled in another ("model.layers.3.mlp.up_proj.weight" → "blk.3.ffn_up.weight"), for
// the programs that write files; a name neither table knows comes back unchanged.
inline std::string renamed_tensor(const std::string& name, const TensorNames& from, const TensorNames& to) {
    auto fields = [](const TensorNames& n) {
        return std::array<const char*, 17>{n.embedding, n.final_norm, n.lm_head, n.attn_norm, n.wq,     n.wk,
                                           n.wv,        n.wo,         n.bq,      n.bk,        n.bv,     n.q_norm,
                                           n.k_norm,    n.ffn_norm,   n.w_gate,  n.w_up,      n.w_down};
    };
    const auto source = fields(from), target = fields(to);
    for (size_t i = 0; i < 3; ++i)
        if (name == source[i]) return target[i];
    const std::string prefix = from.layer_prefix;
    if (name.rfind(prefix, 0) != 0) return name;
    const size_t dot = name.find('.', prefix.size());
    if (dot == std::string::npos) return name;
    const std::string layer = name.substr(prefix.size(), dot - prefix.size()), rest = name.substr(dot + 1);
    for (size_t i = 3; i < source.size(); ++i)
        if (rest == source[i]) return to.layer_prefix + layer + "." + target[i];
    return name;
}

// Points a Model's weights at the tensors of a file, by the format's names. The classifier is the embedding when the
// config says tied and the file has no separate one (some tied checkpoints still ship it: then the file decides, so
// the parameter count stays honest). Shapes are checked afterwards, by validate_model.
inline void attach_tensors(Model& model, const std::unordered_map<std::string, Tensor>& tensors, const TensorNames& names) {
    auto take = [&](const std::string& name) -> Tensor {
        auto found = tensors.find(name);
        if (found == tensors.end()) fail(model.source, ": missing tensor ", name);
        return found->second;
    };
    ModelConfig& c = model.config;
    model.embedding = take(names.embedding);
    model.final_norm = take(names.final_norm);
    c.tied_embeddings = c.tied_embeddings && !tensors.count(names.lm_head);  // a file that ships the head uses it
    model.lm_head = c.tied_embeddings ? model.embedding : take(names.lm_head);
    for (int i = 0; i < c.n_layers; ++i) {
        const std::string p = names.layer_prefix + std::to_string(i) + ".";
        LayerWeights layer;
        layer.attn_norm = take(p + names.attn_norm);
        layer.wq = take(p + names.wq);
        layer.wk = take(p + names.wk);
        layer.wv = take(p + names.wv);
        layer.wo = take(p + names.wo);
        if (c.qkv_bias) {  // only the architectures that have them: a stray bias elsewhere stays unused
            layer.bq = take(p + names.bq);
            layer.bk = take(p + names.bk);
            layer.bv = take(p + names.bv);
        }
        if (c.qk_norm) {
            layer.q_norm = take(p + names.q_norm);
            layer.k_norm = take(p + names.k_norm);
        }
        layer.ffn_norm = take(p + names.ffn_norm);
        layer.w_gate = take(p + names.w_gate);
        layer.w_up = take(p + names.w_up);
        layer.w_down = take(p + names.w_down);
        model.layers.push_back(std::move(layer));
    }
}

}  // namespace detail

// A Hugging Face folder: config.json, and model.safetensors or shards listed in model.safetensors.index.json.
inline Model load_hugging_face(const std::filesystem::path& folder, FileAccess access = FileAccess::Map) {
    Model model;
    model.source = folder.string();
    model.format = ModelFormat::HuggingFace;
    auto config_path = folder / "config.json";
    Json config_json = Json::parse(read_text_file(config_path), config_path.string());
    if (!config_json.is_object()) fail(config_path.string(), ": not a JSON object");
    model.config = detail::config_from_hugging_face(config_json, config_path.string());
    // generation_config.json often lists more end ids than config.json (Llama 3 Instruct: <|eot_id|> as well).
    if (auto generation_path = folder / "generation_config.json"; std::filesystem::exists(generation_path)) {
        Json generation = Json::parse(read_text_file(generation_path), generation_path.string());
        if (const Json* eos = generation.find("eos_token_id")) {
            std::vector<const Json*> ids;
            if (eos->is_number()) ids.push_back(eos);
            if (eos->is_array())
                for (const Json& id : eos->as_array()) ids.push_back(&id);
            for (const Json* id : ids) {
                if (!id->is_number()) fail(generation_path.string(), ": eos_token_id holds a value that is not a token id");
                int value = static_cast<int>(id->as_int());
                if (std::find(model.config.eos_ids.begin(), model.config.eos_ids.end(), value) == model.config.eos_ids.end())
                    model.config.eos_ids.push_back(value);
            }
        }
    }

    // All tensors of all shards in one table: a model split in files is still one set of names.
    std::unordered_map<std::string, Tensor> tensors;
    auto add_file = [&](const std::filesystem::path& path) {
        auto file = std::make_shared<MappedFile>(path, access);
        for (auto& [name, tensor] : detail::read_safetensors(*file)) tensors[name] = std::move(tensor);
        model.files.push_back(std::move(file));  // the Model keeps every mapping its tensors point into
    };
    auto index_path = folder / "model.safetensors.index.json";
    if (std::filesystem::exists(folder / "model.safetensors")) {
        add_file(folder / "model.safetensors");
    } else if (std::filesystem::exists(index_path)) {  // sharded: the index maps each tensor name to its file
        Json index = Json::parse(read_text_file(index_path), index_path.string());
        std::vector<std::string> shards;
        const Json* map = index.find("weight_map");
        if (!map || !map->is_object()) fail(index_path.string(), ": missing object field \"weight_map\"");
        for (const auto& [name, shard] : map->as_object()) {
            if (!shard.is_string()) fail(index_path.string(), ": weight_map entry ", name, " is not a file name");
            // A shard is a file beside the index: a path that leaves the folder would let a downloaded model read
            // (and print the first bytes of) any file on the machine.
            std::filesystem::path shard_path(shard.as_string());
            bool inside = !shard_path.empty() && shard_path.is_relative() && shard_path.has_filename();
            for (const auto& part : shard_path) inside = inside && part != "..";
            if (!inside)
                fail(index_path.string(), ": weight_map entry ", name, " names \"", shard.as_string(),
                     "\", which is not a file inside the model folder");
            if (std::find(shards.begin(), shards.end(), shard.as_string()) == shards.end()) shards.push_back(shard.as_string());
        }
        for (const auto& shard : shards) add_file(folder / shard);
    } else {
        fail(folder.string(), ": no model.safetensors or model.safetensors.index.json");
    }

    detail::attach_tensors(model, tensors, detail::hugging_face_names);
    detail::validate_model(model);
    return model;
}

// ---- GGUF -----------------------------------------------------------------------------------------------------------
// Layout: "GGUF", u32 version, u64 tensor count, u64 metadata count, metadata (key, type, value)*, tensor infos
// (name, n_dims, dims innermost first, type, offset)*, padding to general.alignment, tensor data. Strings are u64
// length + bytes. Every read is bounds-checked: a truncated or hostile file gets an error, never a wild read.

namespace detail {

// Little-endian reads from a mapped file, each checked against its end before it happens.
class ByteReader {
public:
    explicit ByteReader(const MappedFile& file, const char* format = "GGUF") : file_(file), format_(format) {}

    template <class T>
    T read() {
        need(sizeof(T), "a value");
        T value;
        std::memcpy(&value, file_.data() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return value;
    }
    std::string read_string() {
        uint64_t length = read<uint64_t>();
        need(length, "a string");
        std::string text(reinterpret_cast<const char*>(file_.data() + pos_), length);
        pos_ += length;
        return text;
    }
    void need(uint64_t bytes, const char* what) const {
        if (bytes > file_.size() - pos_)
            fail(file_.path(), ": truncated ", format_, " file: ", what, " of ", bytes, " bytes at offset ", pos_,
                 " runs past the end (", file_.size(), " bytes)");
    }
    size_t position() const { return pos_; }
    void seek(size_t pos) { pos_ = pos; }

private:
    const MappedFile& file_;
    const char* format_;  // for messages: "GGUF", "llama2.c tokenizer"
    size_t pos_ = 0;
};

// GGUF metadata values as one small variant: numbers as double/int64, strings, and arrays of either.
struct GgufValue {
    std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, std::vector<double>, std::vector<std::string>> value;
    uint32_t type = 0, item_type = 0;  // the file's type tags (an array's items: item_type), so it can be written back
};

// One metadata value, its type tag read first (appendix A decodes the 13 types).
inline GgufValue gguf_read_value(ByteReader& in, uint32_t type, const std::string& path, const std::string& key);
inline const char* gguf_tensor_type_name(uint32_t type);  // "Q4_K" for GGUF type id 12; nullptr when unknown

// The weight type of a GGUF type id; nullopt for the types infer does not decode (IQ*, TQ*, ...).
inline std::optional<DType> dtype_of_gguf_type(uint32_t type) {
    for (int i = 0; i < dtype_count; ++i)
        if (dtype_block(static_cast<DType>(i)).gguf_type == static_cast<int>(type)) return static_cast<DType>(i);
    return std::nullopt;
}
inline std::string supported_dtype_names() {
    std::string names;
    for (int i = 0; i < dtype_count; ++i) names += (i ? ", " : "") + std::string(dtype_name(static_cast<DType>(i)));
    return names;
}

}  // namespace detail

struct GgufFile {
    std::shared_ptr<MappedFile> file;
    uint32_t version = 0;
    std::map<std::string, detail::GgufValue> metadata;
    std::unordered_map<std::string, Tensor> tensors;

    // Typed lookups whose errors name the file and the key (appendix A).
    const detail::GgufValue* find(const std::string& key) const;
    int64_t integer(const std::string& key) const;
    int64_t integer_or(const std::string& key, int64_t fallback) const;
    double number_or(const std::string& key, double fallback) const;
    std::string string_or(const std::string& key, std::string fallback) const;
    template <class T>
    const std::vector<T>* array(const std::string& key) const {
        const detail::GgufValue* v = find(key);
        if (!v) return nullptr;
        if (auto* items = std::get_if<std::vector<T>>(&v->value)) return items;
        fail(file->path(), ": GGUF metadata ", key, " is not an array of the expected type");
    }
};

// The whole file in one pass over its header: metadata into a map, tensor infos into views of the mapping.
inline GgufFile read_gguf(const std::filesystem::path& path, FileAccess access = FileAccess::Map) {
    GgufFile gguf;
    gguf.file = std::make_shared<MappedFile>(path, access);
    const MappedFile& file = *gguf.file;
    detail::ByteReader in(file);
    if (file.size() < 4 || std::memcmp(file.data(), "GGUF", 4) != 0)
        fail(path.string(), ": not a GGUF file (bad magic; expected \"GGUF\")");
    in.seek(4);
    gguf.version = in.read<uint32_t>();
    if (gguf.version != 2 && gguf.version != 3)
        fail(path.string(), ": unsupported GGUF version ", gguf.version, " (supported: 2, 3)");
    uint64_t tensor_count = in.read<uint64_t>();
    uint64_t metadata_count = in.read<uint64_t>();
    for (uint64_t i = 0; i < metadata_count; ++i) {  // hyperparameters, vocabulary, chat template: all key → value
        std::string key = in.read_string();
        uint32_t type = in.read<uint32_t>();
        gguf.metadata[key] = detail::gguf_read_value(in, type, path.string(), key);
    }
    struct Info {
        Tensor tensor;
        uint64_t offset;
    };
    std::vector<Info> infos;
    in.need(tensor_count, "the tensor list");  // a cheap bound before reserving: each entry takes bytes
    for (uint64_t i = 0; i < tensor_count; ++i) {
        Info info;
        info.tensor.name = in.read_string();
        uint32_t n_dims = in.read<uint32_t>();
        if (n_dims == 0 || n_dims > 4) fail(path.string(), ": tensor ", info.tensor.name, " has ", n_dims, " dimensions");
        std::vector<int64_t> dims(n_dims);
        for (auto& dim : dims) {
            uint64_t value = in.read<uint64_t>();
            if (value > (uint64_t{1} << 60)) fail(path.string(), ": tensor ", info.tensor.name, " has dimension ", value);
            dim = static_cast<int64_t>(value);
        }
        detail::checked_element_count(dims, path.string() + ": tensor " + info.tensor.name);
        std::reverse(dims.begin(), dims.end());  // GGUF lists the innermost dimension first
        info.tensor.shape = dims;
        uint32_t type = in.read<uint32_t>();  // each tensor its own type: a "Q4_K_M" file mixes several
        std::optional<DType> dtype = detail::dtype_of_gguf_type(type);
        if (!dtype) {
            const char* name = detail::gguf_tensor_type_name(type);
            fail(path.string(), ": tensor ", info.tensor.name, " has type ", name ? name : ("unknown (" + std::to_string(type) + ")"),
                 ", which is not supported (supported: ", detail::supported_dtype_names(), ")");
        }
        info.tensor.dtype = *dtype;
        if (dims.back() % dtype_block(*dtype).elements != 0)  // rows are whole blocks; dims.back() is the row length
            fail(path.string(), ": tensor ", info.tensor.name, " of type ", dtype_name(*dtype), " has rows of ", dims.back(),
                 " weights, not a multiple of its block of ", dtype_block(*dtype).elements);
        info.offset = in.read<uint64_t>();  // from the start of the data section, which is only known at the end
        infos.push_back(std::move(info));
    }
    uint64_t alignment = static_cast<uint64_t>(gguf.integer_or("general.alignment", 32));
    if (alignment == 0) fail(path.string(), ": general.alignment is 0");
    uint64_t data_start = (in.position() + alignment - 1) / alignment * alignment;
    for (auto& info : infos) {  // every tensor must lie inside the file: the checks are written not to overflow
        uint64_t bytes = info.tensor.bytes();
        if (data_start > file.size() || info.offset > file.size() - data_start || bytes > file.size() - data_start - info.offset)
            fail(path.string(), ": tensor ", info.tensor.name, " (", bytes, " bytes at data offset ", info.offset,
                         ") runs past the end of the file (", file.size(), " bytes; truncated?)");
        info.tensor.data = file.data() + data_start + info.offset;
        gguf.tensors[info.tensor.name] = std::move(info.tensor);
    }
    return gguf;
}

// The tokenizer.ggml.* metadata as a Vocabulary (appendix E); an unsupported tokenizer.ggml.model leaves it empty.
namespace detail {
inline Vocabulary vocabulary_from_gguf(const GgufFile& gguf);
}

// A GGUF file: hyperparameters under "<architecture>.*" keys, the vocabulary under "tokenizer.ggml.*", tensors under
// llama.cpp's names. One file holds everything a model needs.
inline Model load_gguf(const std::filesystem::path& path, FileAccess access = FileAccess::Map) {
    GgufFile gguf = read_gguf(path, access);
    Model model;
    model.source = path.string();
    model.format = ModelFormat::Gguf;
    model.files.push_back(gguf.file);
    ModelConfig& c = model.config;
    c.architecture = gguf.string_or("general.architecture", "");
    const Architecture* arch = find_architecture(c.architecture, true);
    if (!arch)
        fail(model.source, ": unsupported general.architecture \"", c.architecture, "\" (supported: ",
             architecture_names(true), ")");
    const std::string a = c.architecture + ".";  // "llama.embedding_length", "qwen2.block_count", ...
    c.dim = static_cast<int>(gguf.integer(a + "embedding_length"));
    c.n_layers = static_cast<int>(gguf.integer(a + "block_count"));
    c.ffn_dim = static_cast<int>(gguf.integer(a + "feed_forward_length"));
    c.n_heads = static_cast<int>(gguf.integer(a + "attention.head_count"));
    c.n_kv_heads = static_cast<int>(gguf.integer_or(a + "attention.head_count_kv", c.n_heads));
    if (c.n_heads <= 0) fail(model.source, ": ", a, "attention.head_count must be positive");
    c.head_dim = static_cast<int>(gguf.integer_or(a + "attention.key_length", c.dim / c.n_heads));
    c.context_length = static_cast<int>(gguf.integer_or(a + "context_length", 2048));  // what the model was trained for
    c.rope_theta = gguf.number_or(a + "rope.freq_base", 10000.0);
    c.norm_eps = gguf.number_or(a + "attention.layer_norm_rms_epsilon", 1e-5);
    c.rope_style = arch->gguf_rope_pairs ? RopeStyle::AdjacentPairs : RopeStyle::HalfRotation;  // llama.cpp's permutation
    c.qkv_bias = arch->qkv_bias;
    c.qk_norm = arch->qk_norm;
    std::string scaling = gguf.string_or(a + "rope.scaling.type", "none");
    if (scaling == "linear") {
        c.rope_scaling.kind = RopeScaling::Kind::Linear;
        c.rope_scaling.factor = gguf.number_or(a + "rope.scaling.factor", 1);
    } else if (scaling != "none" && scaling != "yarn") {
        fail(model.source, ": unsupported ", a, "rope.scaling.type \"", scaling, "\"");
    } else if (scaling == "yarn") {
        fail(model.source, ": unsupported ", a, "rope.scaling.type \"yarn\"");
    }
    // End ids: EOS, and a chat model's end-of-turn (Llama 3's <|eot_id|>), so generation stops where the model does.
    c.bos_id = static_cast<int>(gguf.integer_or("tokenizer.ggml.bos_token_id", -1));
    if (gguf.find("tokenizer.ggml.eos_token_id")) c.eos_ids.push_back(static_cast<int>(gguf.integer("tokenizer.ggml.eos_token_id")));
    if (gguf.find("tokenizer.ggml.eot_token_id")) {
        int eot = static_cast<int>(gguf.integer("tokenizer.ggml.eot_token_id"));
        if (std::find(c.eos_ids.begin(), c.eos_ids.end(), eot) == c.eos_ids.end()) c.eos_ids.push_back(eot);
    }

    // GGUF has no tie flag: a file without output.weight reads its classifier from the embedding.
    c.tied_embeddings = true;
    detail::attach_tensors(model, gguf.tensors, detail::gguf_names);
    c.vocab_size = static_cast<int>(model.embedding.rows());  // GGUF has no vocab_size key: the embedding says it
    // Llama 3's frequency scaling is baked into the file as per-frequency divisors.
    if (auto found = gguf.tensors.find("rope_freqs.weight"); found != gguf.tensors.end()) {
        const Tensor& freqs = found->second;
        for (int64_t i = 0; i < freqs.elements(); ++i) model.rope_freq_divisors.push_back(freqs.at(i));
    }
    model.vocab = detail::vocabulary_from_gguf(gguf);
    detail::validate_model(model);
    detail::add_row_groups(model);
    return model;
}

// ---- llama2.c -------------------------------------------------------------------------------------------------------
// Karpathy's legacy format: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
// vocab_size means a separate classifier), then float32 arrays with all layers of one kind stored together. Its q/k
// rows use adjacent-pair RoPE. The vocabulary lives in a separate tokenizer.bin.

// llama2.c's tokenizer.bin: per token a float score, an int32 length and the bytes (appendix E). vocab_size < 0 reads
// entries until the end of the file (the file itself does not say how many it holds).
inline Vocabulary load_llama2c_tokenizer(const std::filesystem::path& path, int vocab_size);

namespace detail {
// Whether the file parses, to its last byte, as llama2.c's tokenizer.bin (u32 max length, then per token a float
// score, an i32 length and the bytes): the mistake of passing the tokenizer as the model deserves its own message.
inline bool is_llama2c_tokenizer(const MappedFile& file) {
    if (file.size() < 4) return false;
    uint32_t max_length;
    std::memcpy(&max_length, file.data(), 4);
    if (max_length == 0 || max_length > 1024) return false;
    size_t at = 4, tokens = 0;
    while (at < file.size()) {
        int32_t length;
        if (file.size() - at < 8) return false;
        std::memcpy(&length, file.data() + at + 4, 4);
        if (length < 0 || static_cast<uint32_t>(length) > max_length || file.size() - at - 8 < static_cast<size_t>(length)) return false;
        at += 8 + static_cast<size_t>(length);
        ++tokens;
    }
    return tokens >= 3;
}
}  // namespace detail

// A llama2.c checkpoint: the header gives the shape; everything else follows from it, so the file size is checked
// against the shape before any view is made.
inline Model load_llama2c(const std::filesystem::path& path, const std::filesystem::path& tokenizer_path,
                          FileAccess access = FileAccess::Map) {
    Model model;
    model.source = path.string();
    model.format = ModelFormat::Llama2c;
    auto file = std::make_shared<MappedFile>(path, access);
    model.files.push_back(file);
    if (file->size() < 28) fail(model.source, ": too small for a llama2.c header (", file->size(), " bytes)");
    if (detail::is_llama2c_tokenizer(*file))
        fail(model.source, ": this is a llama2.c tokenizer file, not a model; give it with --tokenizer and the checkpoint "
                           "as the model");
    int32_t header[7];
    std::memcpy(header, file->data(), sizeof header);
    ModelConfig& c = model.config;
    c.architecture = "llama";
    c.dim = header[0];
    c.ffn_dim = header[1];
    c.n_layers = header[2];
    c.n_heads = header[3];
    c.n_kv_heads = header[4];
    if (header[5] == INT32_MIN) fail(model.source, ": bad llama2.c header (vocabulary size ", header[5], ")");  // |x| overflows
    c.vocab_size = std::abs(header[5]);
    c.context_length = header[6];
    c.tied_embeddings = header[5] > 0;  // the format's one flag, hidden in the sign of the vocabulary size
    if (c.n_heads <= 0 || c.dim <= 0) fail(model.source, ": bad llama2.c header (dim ", c.dim, ", heads ", c.n_heads, ")");
    c.head_dim = c.dim / c.n_heads;
    c.rope_style = RopeStyle::AdjacentPairs;  // Meta's layout, as llama2.c's exporter writes it
    c.rope_theta = 10000;                     // not in the header: llama2.c's run.c hard-codes both
    c.norm_eps = 1e-5;
    c.bos_id = 1;
    c.eos_ids = {2, 1};  // run.c ends a story when the model starts the next one with BOS
    detail::validate_config(c, model.source);

    const int64_t D = c.dim, F = c.ffn_dim, L = c.n_layers, V = c.vocab_size, S = c.context_length;
    const int64_t q_width = int64_t{c.n_heads} * c.head_dim, kv_width = int64_t{c.n_kv_heads} * c.head_dim;
    // The header's numbers come from the file: the size is estimated in floating point first, so that an absurd header
    // is refused before the exact sum below could overflow 64 bits.
    const double rough = (static_cast<double>(V) + L * (2.0 * q_width + 2.0 * kv_width + 3.0 * F + 2.0) + S + 1) * D * 4;
    if (rough > 4e18)
        fail(model.source, ": llama2.c header (dim ", D, ", hidden ", F, ", layers ", L, ", heads ", c.n_heads, ", vocab ",
             V, ", seq_len ", S, ") describes more weights than any file holds (is it a llama2.c checkpoint?)");
    const int64_t floats = V * D + L * D + L * D * q_width + 2 * L * D * kv_width + L * q_width * D + L * D +
                           3 * L * F * D + D + S * c.head_dim + (c.tied_embeddings ? 0 : V * D);
    const uint64_t expected = 28 + static_cast<uint64_t>(floats) * 4;
    if (file->size() != expected)
        fail(model.source, ": llama2.c file is ", file->size(), " bytes but its header (dim ", D, ", hidden ", F,
                     ", layers ", L, ", heads ", c.n_heads, ", kv heads ", c.n_kv_heads, ", vocab ", V, ", seq_len ", S,
                     ") needs ", expected);

    const std::byte* cursor = file->data() + 28;  // the arrays follow the header back to back, in this order
    auto next = [&](const char* name, std::vector<int64_t> shape) {
        Tensor t{name, DType::F32, std::move(shape), cursor};
        cursor += t.bytes();
        return t;
    };
    // Per-layer views into one array per kind: layer i starts i × (size of one layer's tensor) further.
    auto per_layer = [&](const char* name, std::vector<int64_t> shape, auto member) {
        Tensor all = next(name, {L * std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>())});
        model.layers.resize(static_cast<size_t>(L));
        for (int64_t i = 0; i < L; ++i) {
            Tensor& t = model.layers[static_cast<size_t>(i)].*member;
            t = Tensor{std::string(name) + "[" + std::to_string(i) + "]", DType::F32, shape, all.data + i * (all.bytes() / L)};
        }
    };
    model.embedding = next("token_embedding_table", {V, D});
    per_layer("rms_att_weight", {D}, &LayerWeights::attn_norm);
    per_layer("wq", {q_width, D}, &LayerWeights::wq);
    per_layer("wk", {kv_width, D}, &LayerWeights::wk);
    per_layer("wv", {kv_width, D}, &LayerWeights::wv);
    per_layer("wo", {D, q_width}, &LayerWeights::wo);
    per_layer("rms_ffn_weight", {D}, &LayerWeights::ffn_norm);
    per_layer("w1", {F, D}, &LayerWeights::w_gate);
    per_layer("w2", {D, F}, &LayerWeights::w_down);
    per_layer("w3", {F, D}, &LayerWeights::w_up);
    model.final_norm = next("rms_final_weight", {D});
    next("freq_cis", {S * c.head_dim});  // precomputed RoPE tables: we compute our own
    model.lm_head = c.tied_embeddings ? model.embedding : next("wcls", {V, D});
    if (!tokenizer_path.empty()) model.vocab = load_llama2c_tokenizer(tokenizer_path, c.vocab_size);
    detail::validate_model(model);
    return model;
}

// Picks the loader from what the path is: a folder (Hugging Face), a file starting with "GGUF", or a llama2.c .bin
// (whose tokenizer defaults to tokenizer.bin beside it). The one entry point programs call.
inline Model load_model(const std::filesystem::path& path, std::filesystem::path tokenizer_path = {},
                        FileAccess access = FileAccess::Map) {
    std::error_code error;
    if (!std::filesystem::exists(path, error)) fail(path.string(), ": no such file or folder");
    Model model;
    if (std::filesystem::is_directory(path, error)) {
        model = load_hugging_face(path, access);
    } else {
        if (!std::filesystem::is_regular_file(path, error)) fail(path.string(), ": not a regular file or a folder");
        if (detail::ends_with(path.string(), ".json"))
            fail(path.string(), ": a JSON file is not a model; give the folder that holds config.json and the weights");
        char magic[4] = {};
        std::ifstream(path, std::ios::binary).read(magic, 4);
        if (std::memcmp(magic, "GGUF", 4) == 0 || detail::ends_with(path.string(), ".gguf")) {
            model = load_gguf(path, access);
        } else {
            if (tokenizer_path.empty()) {
                tokenizer_path = path.parent_path() / "tokenizer.bin";
                if (!std::filesystem::exists(tokenizer_path)) tokenizer_path.clear();  // ids only, then
            }
            model = load_llama2c(path, tokenizer_path, access);
        }
    }
    return model;
}

// ==== 03 TOKENIZER ===================================================================================================
// Text to token ids and back, for every format the loaders read, behind one Tokenizer. Two families: SentencePiece
// score-based BPE (llama2.c tokenizer.bin, GGUF "llama"): merge the adjacent pair whose piece scores highest; and
// Hugging Face ranked-merge BPE (tokenizer.json, GGUF "gpt2"): split off added tokens, normalize, cut the text into
// pre-tokens (a regex, or SentencePiece's "▁" rule), then merge the pair with the lowest merge rank. Both keep the
// symbols in a linked list and the candidate pairs in a heap: O(n log n) in a word's length. Cost: about a microsecond
// per word (cached words less), negligible next to prefill. A model only ever sees ids, so the one bug to fear is a
// tokenizer that disagrees with the one the model was trained with: the tests hold every format against Hugging Face's
// ids. (chapter 03)

namespace detail {
// UTF-8, as the tokenizer needs it (appendix C): the length a lead byte announces (0: not a lead byte); the offset of
// the first invalid sequence (npos: none); bytes to text with each invalid run as one U+FFFD, as Hugging Face decodes.
inline int utf8_sequence_length(unsigned char lead);
inline size_t find_invalid_utf8(std::string_view text);
inline std::string utf8_lossy(std::string_view bytes);
inline bool starts_with(std::string_view text, std::string_view prefix);
inline bool ends_with_replacement(std::string_view text);  // a character whose remaining bytes are still to come
class Regex;  // the pre-tokenizers' split patterns (appendix D)

// The byte a byte token stands for: "<0x0A>" is 10. SentencePiece vocabularies spell every byte this way so that any
// text can be encoded (byte fallback). -1 for anything else, "<0x-8>" and "<0xZZ>" included: files are untrusted.
inline int byte_token_value(std::string_view piece) {
    auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
    if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>' || hex(piece[3]) < 0 || hex(piece[4]) < 0) return -1;
    return hex(piece[3]) * 16 + hex(piece[4]);
}
}  // namespace detail

// ---- The pipeline's parts -------------------------------------------------------------------------------------------
// Hugging Face's tokenizer.json names each stage's component; these are the ones Llama 2/3, Mistral, Qwen2/3, SmolLM,
// TinyLlama and GPT-2 use. The loader turns each JSON component into one of these steps (a Sequence becomes several).

namespace detail {

struct AddedToken {
    int id = -1;
    std::string content;
    bool special = false;      // a control token (BOS, <|im_start|>): its text stays in a raw decode
    bool lstrip = false;       // swallow the whitespace before it
    bool rstrip = false;       // … and after it
    bool single_word = false;  // match only between non-word characters
    bool normalized = false;   // matched in the normalized text (else in the raw text, before normalization)
};

struct NormalizerStep {
    enum class Kind { Prepend, Replace, Nfc } kind = Kind::Prepend;
    std::string text;                    // Prepend: the prefix; Replace: the literal pattern
    std::shared_ptr<const Regex> regex;  // Replace with a regex pattern
    std::string content;                 // Replace: the replacement
};

struct PreTokenizerStep {
    enum class Kind { Metaspace, ByteLevel, Split, Digits } kind = Kind::Metaspace;
    enum class Prepend { Always, First, Never } prepend = Prepend::Always;  // Metaspace
    std::string replacement = "\xE2\x96\x81";                              // Metaspace: "▁"
    bool split = true;                                                     // Metaspace: cut before each "▁"
    bool add_prefix_space = false;                                         // ByteLevel
    bool use_regex = true;                                                 // ByteLevel: cut with GPT-2's pattern
    std::shared_ptr<const Regex> regex;                                    // Split (or ByteLevel's)
    std::string literal;                                                   // Split with a {"String": ...} pattern
    bool remove_matches = false;                                           // Split behaviour Removed (else Isolated)
    bool individual_digits = false;                                        // Digits
};

struct DecoderStep {
    enum class Kind { ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip } kind = Kind::Fuse;
    std::string pattern, content;  // Replace; Strip's content; Metaspace's replacement in `pattern`
    bool drop_first_marker = true; // Metaspace: the first token's "▁" is the prepended one (prepend scheme not never)
    int start = 0, stop = 0;       // Strip: how many `content` characters to remove at each end
};

// One piece of text on its way to the model, and whether it starts the input (Metaspace's "first" prepend scheme).
struct Piece {
    std::string text;
    bool at_start = false;
};

}  // namespace detail

// ---- Tokenizer ------------------------------------------------------------------------------------------------------

namespace detail {
struct TokenizerBuilder;  // builds a Tokenizer's state from each format (appendix E)
}

class Tokenizer {
public:
    enum class Kind {
        SentencePieceScores,  // llama2.c tokenizer.bin, GGUF "llama": merge by piece score
        Bpe                   // tokenizer.json, GGUF "gpt2": merge by rank, with normalizers and pre-tokenizers
    };

    Tokenizer() = default;

    // Text to ids. add_special_tokens adds what the tokenizer adds by default: BOS for Llama 2, <|begin_of_text|> for
    // Llama 3 Instruct, nothing for GPT-2 or Qwen (Hugging Face's post-processor; add_bos_token for the other formats).
    // Special-token text written in `text` ("<s>", "<|im_start|>") always becomes its id, as Hugging Face does.
    std::vector<int> encode(std::string_view text, bool add_special_tokens = true) const {
        const State& s = state();
        if (size_t bad = detail::find_invalid_utf8(text); bad != std::string_view::npos)
            fail("invalid UTF-8 in the input text at byte offset ", bad);
        std::vector<int> ids;
        if (s.kind == Kind::SentencePieceScores) {
            if (add_special_tokens && s.add_bos && s.bos_id >= 0) ids.push_back(s.bos_id);
            encode_sentencepiece(text, ids);
            if (add_special_tokens && s.add_eos && !s.eos_ids.empty()) ids.push_back(s.eos_ids[0]);
            return ids;
        }
        // Added tokens matched in the raw text first; the rest is normalized, then searched for normalized added
        // tokens, then cut into pre-tokens, each of which the BPE model turns into ids.
        for (const Segment& raw : split_added_tokens(text, false)) {
            if (raw.id >= 0) {
                ids.push_back(raw.id);
                continue;
            }
            std::string normalized = normalize(raw.text);
            for (const Segment& part : split_added_tokens(normalized, true)) {
                if (part.id >= 0) {
                    ids.push_back(part.id);
                    continue;
                }
                for (const detail::Piece& piece : pre_tokenize(std::string(part.text), raw.offset == 0 && part.offset == 0))
                    encode_word(piece.text, ids);
            }
        }
        if (!add_special_tokens) return ids;
        if (s.has_template) {
            std::vector<int> templated;
            for (const auto& item : s.template_items) {
                if (item.is_sequence) templated.insert(templated.end(), ids.begin(), ids.end());
                else templated.insert(templated.end(), item.ids.begin(), item.ids.end());
            }
            return templated;
        }
        if (!s.has_post_processor) {  // no post-processor: tokenizer_config.json's add_bos_token / add_eos_token
            if (s.add_bos && s.bos_id >= 0) ids.insert(ids.begin(), s.bos_id);
            if (s.add_eos && !s.eos_ids.empty()) ids.push_back(s.eos_ids[0]);
        }
        return ids;
    }

    // Ids to text as Hugging Face's raw decode: special tokens kept as their text, no clean-up of spaces. Bytes that
    // do not form UTF-8 become U+FFFD.
    std::string decode(std::span<const int> ids) const {
        const State& s = state();
        if (s.kind == Kind::SentencePieceScores) {
            std::string text;
            int previous = -1;
            for (int id : ids) {
                text += sentencepiece_bytes(id, previous);
                previous = id;
            }
            return detail::utf8_lossy(text);
        }
        std::vector<std::string> tokens;
        tokens.reserve(ids.size());
        for (int id : ids) tokens.push_back(token_text(id));
        if (s.decoders.empty()) {  // Hugging Face joins undecoded tokens with spaces
            std::string text;
            for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
            return detail::utf8_lossy(text);
        }
        for (const detail::DecoderStep& step : s.decoders) tokens = apply_decoder(step, std::move(tokens));
        std::string text;
        for (const std::string& token : tokens) text += token;
        return detail::utf8_lossy(text);
    }

    Kind kind() const { return state().kind; }
    int vocab_size() const { return static_cast<int>(state().id_to_token.size()); }
    // What each token adds to a text when it is not the text's first token, as raw bytes ("▁the" and "Ġthe" → " the",
    // <0x0A> → "\n", a piece of a UTF-8 character as that piece); nullopt for a special token, which spells no text
    // (BOS, <|im_start|>, unused pieces). Structured outputs match these bytes against their grammar (section 04).
    std::vector<std::optional<std::string>> all_token_bytes() const;
    // The token's text as the vocabulary spells it ("▁the", "Ġthe", "<0x0A>", "<|im_start|>").
    const std::string& token_text(int id) const {
        if (id < 0 || id >= vocab_size())
            fail("token id ", id, " is outside the vocabulary (", vocab_size(), " tokens)");
        return state().id_to_token[static_cast<size_t>(id)];
    }
    int bos_id() const { return state().bos_id; }                     // -1 when there is none
    const std::vector<int>& eos_ids() const { return state().eos_ids; }  // generation stops at any of them
    const std::string& bos_token() const { return state().bos_token; }   // text for chat templates ("" when none)
    const std::string& eos_token() const { return state().eos_token; }
    const std::string& chat_template() const { return state().chat_template; }  // Jinja source, "" when none
    const std::string& source() const { return state().source; }

    // For teaching: the symbols of one pre-token (normalized and mapped as encode would, e.g. " " → "Ġ") before the
    // first merge and after each merge, ending with its tokens. Ranked-merge BPE tokenizers only.
    std::vector<std::vector<std::string>> merge_steps(std::string_view pre_token) const {
        const State& s = state();
        if (s.kind != Kind::Bpe)
            fail(s.source, ": merge_steps shows ranked merges; this is a SentencePiece score tokenizer");
        if (size_t bad = detail::find_invalid_utf8(pre_token); bad != std::string_view::npos)
            fail("invalid UTF-8 in the input text at byte offset ", bad);
        std::vector<detail::Piece> pieces = pre_tokenize(normalize(pre_token), true);
        if (pieces.size() != 1)
            fail("merge_steps: \"", pre_token, "\" is ", pieces.size(), " pre-tokens for this tokenizer, not one");
        std::vector<std::vector<std::string>> steps;
        merge_word(pieces[0].text, &steps);
        return steps;
    }

private:
    friend struct detail::TokenizerBuilder;
    friend class TextStream;

    struct TemplateItem {
        bool is_sequence = false;  // the encoded text ("$A"); else the special token's ids
        std::vector<int> ids;
    };

    // Everything a tokenizer knows, shared by its copies: a Tokenizer is cheap to copy and pass by value.
    struct State {
        Kind kind = Kind::Bpe;
        std::string source;  // the file it came from, for messages
        std::vector<std::string> id_to_token;
        std::unordered_map<std::string, int> token_to_id;
        int bos_id = -1;
        std::vector<int> eos_ids;
        std::string bos_token, eos_token, chat_template;
        bool add_bos = false, add_eos = false;
        std::array<int, 256> byte_ids = [] {  // the <0xNN> tokens, -1 where absent
            std::array<int, 256> none;
            none.fill(-1);
            return none;
        }();

        // SentencePiece scores.
        std::vector<float> scores;
        std::vector<Vocabulary::Type> types;
        std::vector<int> sentencepiece_specials;  // control/user-defined pieces matched whole, longest first
        bool add_space_prefix = true;
        int unk_id = -1;

        // Ranked-merge BPE.
        std::unordered_map<uint64_t, std::pair<int, int>> merges;  // (left id << 32 | right id) → (rank, merged id)
        bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
        std::vector<detail::AddedToken> added;                        // longest content first
        std::array<std::vector<int>, 256> added_by_first_byte[2];     // [normalized?][first byte] → indices into added
        std::vector<detail::NormalizerStep> normalizers;
        std::vector<detail::PreTokenizerStep> pre_tokenizers;
        std::vector<detail::DecoderStep> decoders;
        bool has_post_processor = false, has_template = false;
        std::vector<TemplateItem> template_items;

        // Words seen before and their ids: text repeats its words, and a lookup is cheaper than merging again.
        mutable std::mutex cache_mutex;
        mutable std::unordered_map<std::string, std::vector<int>> word_cache;
    };

    const State& state() const {
        if (!state_) fail("this Tokenizer is empty (default-constructed): load one with load_tokenizer");
        return *state_;
    }

    std::shared_ptr<State> state_;

    // ---- SentencePiece scores -----------------------------------------------------------------------------------

    // Splits around control and user-defined pieces written in the text ("<s>"), which become their ids; each stretch of
    // plain text between them goes through encode_sentencepiece_plain (appendix E).
    void encode_sentencepiece(std::string_view text, std::vector<int>& ids) const;

    void encode_sentencepiece_plain(std::string_view plain, bool dummy_prefix, std::vector<int>& ids) const {
        const State& s = *state_;
        std::string text;
        if (dummy_prefix && s.add_space_prefix) text += "\xE2\x96\x81";
        for (char ch : plain) {
            if (ch == ' ') text += "\xE2\x96\x81";
            else text += ch;
        }
        // One symbol per UTF-8 character, kept as a doubly linked list so merges are O(1).
        struct Symbol {
            size_t begin, length;
            int prev, next;
        };
        std::vector<Symbol> symbols;
        for (size_t i = 0; i < text.size();) {
            size_t length = std::min<size_t>(detail::utf8_sequence_length(static_cast<unsigned char>(text[i])), text.size() - i);
            int index = static_cast<int>(symbols.size());
            symbols.push_back({i, length, index - 1, index + 1});
            i += length;
        }
        if (symbols.empty()) return;
        symbols.back().next = -1;

        // Candidate merges, best score first, leftmost first on ties. A candidate goes stale when either side has
        // merged since it was queued: its recorded length no longer matches.
        struct Candidate {
            float score;
            int left, right;
            size_t length;
        };
        auto worse = [](const Candidate& a, const Candidate& b) {
            return a.score < b.score || (a.score == b.score && a.left > b.left);
        };
        std::vector<Candidate> queue;
        auto consider = [&](int left, int right) {
            if (left < 0 || right < 0) return;
            std::string_view merged(text.data() + symbols[left].begin, symbols[left].length + symbols[right].length);
            auto found = s.token_to_id.find(std::string(merged));
            if (found == s.token_to_id.end()) return;
            queue.push_back({s.scores[found->second], left, right, merged.size()});
            std::push_heap(queue.begin(), queue.end(), worse);
        };
        for (size_t i = 1; i < symbols.size(); ++i) consider(static_cast<int>(i) - 1, static_cast<int>(i));
        while (!queue.empty()) {
            std::pop_heap(queue.begin(), queue.end(), worse);
            Candidate best = queue.back();
            queue.pop_back();
            Symbol& left = symbols[best.left];
            Symbol& right = symbols[best.right];
            if (left.length == 0 || right.length == 0 || left.length + right.length != best.length) continue;
            left.length += right.length;
            right.length = 0;
            left.next = right.next;
            if (right.next >= 0) symbols[right.next].prev = best.left;
            consider(left.prev, best.left);
            consider(best.left, left.next);
        }
        for (int i = 0; i >= 0; i = symbols[i].next) {
            std::string piece = text.substr(symbols[i].begin, symbols[i].length);
            if (auto found = s.token_to_id.find(piece); found != s.token_to_id.end()) {
                ids.push_back(found->second);
                continue;
            }
            for (unsigned char byte : piece) {  // byte fallback, or <unk> for a vocabulary without byte tokens
                int id = s.byte_ids[byte];
                ids.push_back(id >= 0 ? id : s.unk_id);
            }
        }
    }

    // The bytes one token stands for: "▁" becomes a space, <0xNN> the raw byte, control tokens nothing.
    // `previous` decides SentencePiece's rule that a leading space after BOS (the dummy prefix) is dropped.
    std::string sentencepiece_bytes(int id, int previous) const {
        const State& s = *state_;
        const std::string& piece = token_text(id);
        auto type = s.types[static_cast<size_t>(id)];
        if (type == Vocabulary::Type::Control || type == Vocabulary::Type::Unused) return "";
        if (type == Vocabulary::Type::Byte) return std::string(1, static_cast<char>(detail::byte_token_value(piece)));
        std::string text;
        static constexpr std::string_view space_marker = "\xE2\x96\x81";  // ▁
        for (size_t i = 0; i < piece.size();) {
            if (piece.compare(i, space_marker.size(), space_marker) == 0) {
                text += ' ';
                i += space_marker.size();
            } else {
                text += piece[i++];
            }
        }
        bool starts_text = previous < 0 || previous == s.bos_id;
        if (starts_text && s.add_space_prefix && !text.empty() && text[0] == ' ') text.erase(0, 1);
        return text;
    }

    // ---- Ranked-merge BPE: added tokens, normalizer, pre-tokenizer, model, decoder ------------------------------
    // encode() above runs the stages in Hugging Face's order. The merge loop (encode_word, merge_word) is the lesson
    // and stays here; the other stages' mechanics are appendix E, each declared here with what it does.

    struct Segment {
        std::string_view text;
        int id = -1;      // an added token's id, or -1 for plain text
        size_t offset = 0;  // where it starts in the string that was split
    };

    // Splits `text` around the added tokens whose `normalized` flag matches: leftmost match, longest on ties (Hugging
    // Face's aho-corasick with LeftmostLongest), honouring single_word, lstrip and rstrip.
    std::vector<Segment> split_added_tokens(std::string_view text, bool normalized) const;
    static size_t previous_length(std::string_view text, size_t end);
    static char32_t previous_code_point(std::string_view text, size_t end);

    std::string normalize(std::string_view text) const;
    static std::string replace_all(const std::string& text, const detail::NormalizerStep& step);

    // Cuts regex matches out of `piece` (behaviour Isolated: matches and the text between them are both pieces;
    // Removed: only the text between them).
    static void split_by_matches(const detail::Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                                 bool keep_matches, std::vector<detail::Piece>& out);
    // Regex matches in code points, converted to byte offsets.
    static std::vector<std::pair<size_t, size_t>> byte_matches(const detail::Regex& regex, const std::string& text);

    std::vector<detail::Piece> pre_tokenize(std::string text, bool at_start) const;

    static void apply_pre_tokenizer(const detail::PreTokenizerStep& step, detail::Piece& piece, std::vector<detail::Piece>& out);

    // The BPE model on one pre-token: characters (or their <0xNN> bytes, or <unk>) become symbols in a linked list,
    // then the adjacent pair with the lowest merge rank merges until none is left: a heap keyed by (rank, position)
    // makes that O(n log n) in the word's length. Hugging Face's word.rs does the same.
    void encode_word(const std::string& word, std::vector<int>& ids) const {
        const State& s = *state_;
        if (s.ignore_merges) {  // Llama 3: a pre-token that is itself a token is taken whole
            if (auto found = s.token_to_id.find(word); found != s.token_to_id.end()) {
                ids.push_back(found->second);
                return;
            }
        }
        const bool cacheable = word.size() <= 64;  // long words are rare and would crowd the cache
        if (cacheable) {
            std::lock_guard<std::mutex> lock(s.cache_mutex);
            if (auto found = s.word_cache.find(word); found != s.word_cache.end()) {
                ids.insert(ids.end(), found->second.begin(), found->second.end());
                return;
            }
        }
        std::vector<int> word_ids = merge_word(word, nullptr);
        ids.insert(ids.end(), word_ids.begin(), word_ids.end());
        if (!cacheable) return;
        std::lock_guard<std::mutex> lock(s.cache_mutex);
        if (s.word_cache.size() >= 100000) s.word_cache.clear();  // bounded: a long-running server sees endless words
        s.word_cache.emplace(word, std::move(word_ids));
    }

    // The merges themselves; `steps`, when given, receives the symbols before the first merge and after each one.
    std::vector<int> merge_word(const std::string& word, std::vector<std::vector<std::string>>* steps) const {
        const State& s = *state_;
        struct Symbol {
            int id;
            int prev, next;
            bool alive;
        };
        std::vector<Symbol> symbols;
        symbols.reserve(word.size());
        auto push = [&](int id) {
            int index = static_cast<int>(symbols.size());
            symbols.push_back({id, index - 1, index + 1, true});
        };
        bool last_unknown = false;
        int n = 0;
        std::string character;
        for (size_t i = 0; i < word.size(); i += static_cast<size_t>(n)) {
            n = std::max(1, detail::utf8_sequence_length(static_cast<unsigned char>(word[i])));
            character.assign(word, i, static_cast<size_t>(n));
            if (auto found = s.token_to_id.find(character); found != s.token_to_id.end()) {
                push(found->second);
                last_unknown = false;
                continue;
            }
            if (s.byte_fallback) {
                bool all = true;
                for (unsigned char byte : character) all = all && s.byte_ids[byte] >= 0;
                if (all) {
                    for (unsigned char byte : character) push(s.byte_ids[byte]);
                    last_unknown = false;
                    continue;
                }
            }
            if (s.unk_id < 0) continue;  // no unk token: Hugging Face drops the character
            if (!(s.fuse_unk && last_unknown)) push(s.unk_id);
            last_unknown = true;
        }
        if (!symbols.empty()) symbols.back().next = -1;

        struct Candidate {
            int rank, position, merged;
        };
        auto worse = [](const Candidate& a, const Candidate& b) {
            return a.rank > b.rank || (a.rank == b.rank && a.position > b.position);
        };
        std::vector<Candidate> queue;
        auto consider = [&](int left) {
            if (left < 0 || symbols[left].next < 0) return;
            uint64_t key = uint64_t(uint32_t(symbols[left].id)) << 32 | uint32_t(symbols[symbols[left].next].id);
            auto found = s.merges.find(key);
            if (found == s.merges.end()) return;
            queue.push_back({found->second.first, left, found->second.second});
            std::push_heap(queue.begin(), queue.end(), worse);
        };
        auto record = [&] {
            if (!steps) return;
            std::vector<std::string> texts;
            for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) texts.push_back(s.id_to_token[symbols[i].id]);
            steps->push_back(std::move(texts));
        };
        record();
        for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) consider(i);
        while (!queue.empty()) {
            std::pop_heap(queue.begin(), queue.end(), worse);
            Candidate best = queue.back();
            queue.pop_back();
            Symbol& left = symbols[best.position];
            // Stale when the left symbol merged away or its pair no longer merges into the same token.
            if (!left.alive || left.next < 0) continue;
            uint64_t key = uint64_t(uint32_t(left.id)) << 32 | uint32_t(symbols[left.next].id);
            auto found = s.merges.find(key);
            if (found == s.merges.end() || found->second.second != best.merged) continue;
            Symbol& right = symbols[left.next];
            left.id = best.merged;
            right.alive = false;
            left.next = right.next;
            if (right.next >= 0) symbols[right.next].prev = best.position;
            consider(left.prev);
            consider(best.position);
            record();
        }
        std::vector<int> word_ids;
        for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) word_ids.push_back(symbols[i].id);
        return word_ids;
    }

    static std::vector<std::string> apply_decoder(const detail::DecoderStep& step, std::vector<std::string> tokens);
};

// Builds the Tokenizer a model file's Vocabulary describes (GGUF, llama2.c); load_tokenizer reads one from a path: a
// folder with tokenizer.json (and tokenizer_config.json beside it for BOS/EOS and the chat template), a tokenizer.json
// file, a .gguf file's vocabulary, or a llama2.c tokenizer.bin. Both are appendix E.
inline Tokenizer tokenizer_from_vocabulary(const Vocabulary& vocab, int bos_id, std::vector<int> eos_ids, std::string source);
inline Tokenizer load_tokenizer(const std::filesystem::path& path);

// ---- Streaming decode -----------------------------------------------------------------------------------------------

// Feeds token ids one at a time and returns the text each one completes, so that the pieces add up to exactly what a
// full decode of the same ids gives. It decodes a short window (the ids it printed last time, as context, plus the
// ids not printed yet) and prints what the window adds to the context's own text. Decoders' first-token rules (the
// dropped leading "▁") thus apply to the context, as they would in the full decode, and the context always starts on
// a whole character (a lone <0xA5> would decode to U+FFFD and spoil the next run of bytes). While the window's text
// ends in U+FFFD (a character whose remaining bytes are still to come) it waits; finish() prints whatever is left.
// The same scheme as Hugging Face's DecodeStream.
class TextStream {
public:
    // `previous`: the id before the first one pushed (the prompt's last), so the first word gets its leading space.
    explicit TextStream(const Tokenizer& tokenizer, int previous = -1) : tokenizer_(tokenizer) {
        if (previous >= 0) {
            ids_.push_back(previous);
            context_size_ = 1;
            context_text_ = tokenizer_.decode(ids_);
        }
    }

    std::string push(int id) {
        ids_.push_back(id);
        std::string text = tokenizer_.decode(ids_);
        if (text.size() <= context_text_.size() || detail::ends_with_replacement(text) || !detail::starts_with(text, context_text_))
            return "";
        std::string added = text.substr(context_text_.size());
        next_context();
        return added;
    }

    std::string finish() {
        std::string text = tokenizer_.decode(ids_);
        std::string rest = detail::starts_with(text, context_text_) ? text.substr(context_text_.size()) : text;
        next_context();
        return rest;
    }

private:
    void next_context() {  // the ids just printed become the context
        ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(context_size_));
        context_size_ = ids_.size();
        context_text_ = tokenizer_.decode(ids_);
    }

    Tokenizer tokenizer_;       // a copy shares the vocabulary: cheap
    std::vector<int> ids_;      // the context ids, then the ids not printed yet
    size_t context_size_ = 0;
    std::string context_text_;  // decode of the context ids
};

// ---- A model's own tokenizer ----------------------------------------------------------------------------------------
namespace detail {
struct TokenizerSlot {
    std::mutex mutex;  // two engines built at once on one Model build its tokenizer once
    std::optional<Tokenizer> tokenizer;
};
inline std::shared_ptr<TokenizerSlot> new_tokenizer_slot() { return std::make_shared<TokenizerSlot>(); }
}  // namespace detail

// Whether tokenizer_for(model) has a tokenizer to give.
inline bool has_tokenizer(const Model& model) {
    if (model.tokenizer_slot) {
        std::lock_guard lock(model.tokenizer_slot->mutex);
        if (model.tokenizer_slot->tokenizer) return true;
    }
    if (model.format == ModelFormat::HuggingFace) return std::filesystem::exists(std::filesystem::path(model.source) / "tokenizer.json");
    return !model.vocab.empty();
}

namespace detail {
inline Tokenizer read_model_tokenizer(const Model& model) {
    if (model.format == ModelFormat::HuggingFace) {
        if (!std::filesystem::exists(std::filesystem::path(model.source) / "tokenizer.json"))
            fail(model.source, ": no tokenizer.json in the model folder to encode text with; pass token ids instead");
        return load_tokenizer(model.source);
    }
    if (model.vocab.empty() && model.format == ModelFormat::Llama2c)
        fail(model.source, ": no tokenizer to encode text with: give llama2.c's tokenizer file (--tokenizer FILE; "
                     "the default is tokenizer.bin beside the model), or pass token ids instead");
    if (model.vocab.empty())
        fail(model.source, ": no vocabulary to tokenize text with (",
                     model.vocab.model_name.empty() ? std::string("no tokenizer.ggml.model")
                                                    : "unsupported tokenizer.ggml.model \"" + model.vocab.model_name + "\"",
                     "); pass token ids instead");
    return tokenizer_from_vocabulary(model.vocab, model.config.bos_id, model.config.eos_ids, model.source);
}
}  // namespace detail

// The model's own tokenizer: a Hugging Face folder's tokenizer.json, a GGUF file's vocabulary ("llama" or "gpt2"),
// llama2.c's tokenizer.bin. Built on the first call and kept in the Model; a Tokenizer is a handle to shared tables,
// so the copy each call returns costs nothing.
inline Tokenizer tokenizer_for(const Model& model) {
    if (!model.tokenizer_slot) fail(model.source, ": this Model was moved from; it has no tokenizer");
    detail::TokenizerSlot& slot = *model.tokenizer_slot;
    std::lock_guard lock(slot.mutex);
    if (!slot.tokenizer) slot.tokenizer = detail::read_model_tokenizer(model);  // a failure is retried next call
    return *slot.tokenizer;
}

// ==== 04 FORWARD PASS ================================================================================================
// Token ids in, next-token logits out, then one token out of the logits. One function serves prefill (a whole prompt:
// T rows, so each weight read from memory is used T times: matrix-matrix, compute-bound) and decode (one token per
// sequence: every weight byte is read for a handful of multiply-adds: matrix-vector, memory-bound). Per layer:
//   x → RMSNorm → q,k,v projections (+bias, +per-head norm) → RoPE → write K/V to the cache → attention over the
//   sequence's cached positions (GQA: query head h reads KV head h / (H / Hkv)) → output projection → + x
//     → RMSNorm → SwiGLU MLP: down(silu(gate(x)) · up(x)) → + x
// then the final norm and the vocabulary projection. The sampler turns a row of logits into one id; generate() runs the
// two in a loop for one request. Chapter 04 measures both regimes and the sampler.

// The tokens of one forward call: each with the sequence it belongs to and its position in that sequence. Tokens of
// many sequences, decoding or prefilling, can share a batch; a token sees only its own sequence's cache.
struct Batch {
    std::vector<int> tokens;     // [T]
    std::vector<int> positions;  // [T]
    std::vector<int> sequences;  // [T]
    std::vector<char> wants_logits;  // [T] logits are computed only where asked (the last prompt token, decode tokens)

    void add(int token, int position, int sequence, bool logits) {
        tokens.push_back(token);
        positions.push_back(position);
        sequences.push_back(sequence);
        wants_logits.push_back(logits);
    }
    void clear() { tokens.clear(), positions.clear(), sequences.clear(), wants_logits.clear(); }
    size_t size() const { return tokens.size(); }
};

// ---- What the forward pass sees of the KV cache ---------------------------------------------------------------------
// Attention at position p needs the keys and values of every earlier position. Recomputing them each step would make
// decode cost the whole prefix again; keeping them costs memory instead: 2 × L × Hkv × Dh × 4 bytes per token in f32,
// half that in f16 or bf16 (at long contexts decode reads more cache than weights, so the 16-bit types trade 2⁻¹¹ or
// 2⁻⁸ of relative rounding per stored value for half the bytes). The storage is one pool of fixed-size blocks of B
// positions, and each sequence has a block table saying which block holds which of its positions (position p: block
// table[p / B], slot p % B), so a sequence grows without copying and without reserving its maximum length up front.
// The forward pass reads a table and writes slots; who gets which block, and how two prompts with a common prefix share
// blocks, is the KV cache of section 05, which owns the tables and one of these pools.

class KVStorage {
public:
    // dtype: how keys and values are stored, F32, F16 or BF16; attention widens them to f32 as it reads.
    KVStorage(const ModelConfig& config, int num_blocks, int block_size = 16, DType dtype = DType::F32)
        : layers_(config.n_layers), block_size_(block_size), num_blocks_(num_blocks), kv_heads_(config.n_kv_heads),
          head_dim_(config.head_dim), dtype_(dtype) {
        if (block_size <= 0) fail("KV cache block size must be positive, found ", block_size);
        if (num_blocks <= 0) fail("KV cache needs at least one block, found ", num_blocks);
        if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16)
            fail("KV cache type must be f32, f16 or bf16, found ", dtype_name(dtype));
        // Left uninitialized on purpose: attention reads only slots it wrote, and untouched pages of a large pool then
        // cost no memory until a sequence reaches them (as a GPU engine's cudaMalloc'd pool); touch() writes them all.
        keys_.reset(static_cast<std::byte*>(::operator new[](pool_bytes(), cache_line)));
        values_.reset(static_cast<std::byte*>(::operator new[](pool_bytes(), cache_line)));
    }

    // Writes zeros over the whole pool, so that its pages' first-touch faults happen here rather than inside the first
    // steps' time, at the price of holding the whole pool's memory from then on.
    void touch() {
        std::memset(keys_.get(), 0, pool_bytes());
        std::memset(values_.get(), 0, pool_bytes());
    }

    // Bytes one token occupies across all layers (keys and values).
    static size_t bytes_per_token(const ModelConfig& c, DType dtype = DType::F32) {
        return 2 * static_cast<size_t>(dtype_bytes(dtype, 1)) * static_cast<size_t>(c.n_layers) * c.n_kv_heads * c.head_dim;
    }

    int block_size() const { return block_size_; }
    int num_blocks() const { return num_blocks_; }
    DType dtype() const { return dtype_; }
    // The [Dh] key or value of one KV head at one slot, in dtype(); the block's next slots of the same head follow it,
    // Dh values apart, and then block + 1's. store_key/store_value write one from f32.
    std::byte* key(int layer, int block, int kv_head, int slot) { return keys_.get() + offset(layer, block, kv_head, slot); }
    std::byte* value(int layer, int block, int kv_head, int slot) { return values_.get() + offset(layer, block, kv_head, slot); }
    const std::byte* key(int layer, int block, int kv_head, int slot) const {
        return keys_.get() + offset(layer, block, kv_head, slot);
    }
    const std::byte* value(int layer, int block, int kv_head, int slot) const {
        return values_.get() + offset(layer, block, kv_head, slot);
    }
    void store_key(int layer, int block, int kv_head, int slot, const float* from) {
        store(from, key(layer, block, kv_head, slot));
    }
    void store_value(int layer, int block, int kv_head, int slot, const float* from) {
        store(from, value(layer, block, kv_head, slot));
    }

private:
    size_t pool_bytes() const {  // of keys, and as many of values
        return static_cast<size_t>(layers_) * num_blocks_ * kv_heads_ * block_size_ * dtype_bytes(dtype_, head_dim_);
    }
    size_t offset(int layer, int block, int kv_head, int slot) const {
        return (((static_cast<size_t>(layer) * kv_heads_ + kv_head) * num_blocks_ + block) * block_size_ + slot) *
               dtype_bytes(dtype_, head_dim_);
    }
    void store(const float* from, std::byte* to) const {
        if (dtype_ == DType::F32) return void(std::memcpy(to, from, static_cast<size_t>(head_dim_) * 4));
        uint16_t* halves = reinterpret_cast<uint16_t*>(to);  // at a multiple of 2·head_dim bytes into the pool
        if (dtype_ == DType::BF16)
            for (int d = 0; d < head_dim_; ++d) halves[d] = f32_to_bf16(from[d]);
        else
            for (int d = 0; d < head_dim_; ++d) halves[d] = f32_to_f16(from[d]);
    }

    int layers_, block_size_, num_blocks_, kv_heads_, head_dim_;
    DType dtype_;
    // Head-major: attention works on one KV head at a time, and a head's blocks lie one after another, so the blocks
    // of a sequence that the pool handed out in order (a prompt's are) read as one run of keys, then one of values,
    // which the hardware prefetchers follow as they do the weights; scattered blocks cost a new run per block.
    std::unique_ptr<std::byte[], CacheLineDelete> keys_, values_;  // [L, Hkv, num_blocks, B, Dh]
};

// A sequence's block table: the blocks that hold its positions, in order.
using BlockTableOf = std::function<const std::vector<int>&(int sequence)>;

class KVCache;  // section 05: the block tables over a KVStorage, prefix caching

// ---- The operations, defined ----------------------------------------------------------------------------------------
// Each operation of the pass has one definition here: the plain loop a reader checks everything else against. The
// matmul and attention kernels also exist as AVX2 and AVX-512 versions (appendix F, CPU kernels), chosen once at run
// time from CPUID; they build every sum in the same order out of the same fused multiply-adds, so every path gives the
// same logits. The forward pass names a path, and the dispatch of appendix F runs its kernels.

enum class CpuKernels { Portable, Avx2, Avx512 };
inline CpuKernels cpu_kernels();  // the path in use: INFER_KERNELS if set, else the widest this CPU runs (appendix F)

namespace detail {

// ---- The matmul kernel: a tile of weight rows × a tile of tokens ----------------------------------------------------
// Every output is the dot product of one weight row with one activation row, and its sum is built the same way
// whatever else is computed beside it: sixteen lanes (lane l takes columns k ≡ l mod 16) accumulated with fused
// multiply-adds over the row's blocks of 16 columns in order, folded in a fixed tree, then the last K % 16 columns
// in order. So a sequence's logits do not depend on its batch-mates (batch invariance), nor on which path computed
// them. What the paths choose is only how many outputs they build at once: a tile of R weight rows × C tokens keeps
// R·C sums in registers, so each weight loaded serves C tokens and each activation loaded serves R rows.

template <DType dtype>
inline float weight_at(const std::byte* row, size_t k) {
    if constexpr (dtype == DType::F32) {
        float value;
        std::memcpy(&value, row + k * 4, 4);
        return value;
    } else {
        uint16_t half;
        std::memcpy(&half, row + k * 2, 2);
        return dtype == DType::BF16 ? bf16_to_f32(half) : f16_to_f32(half);
    }
}

// The fixed tree that folds sixteen lanes into one sum: lanes l and l + 8 first, then pairs four apart, two, one.
inline float fold_lanes(const float* lanes) {
    float half[8];
    for (int lane = 0; lane < 8; ++lane) half[lane] = lanes[lane] + lanes[lane + 8];
    return ((half[0] + half[4]) + (half[2] + half[6])) + ((half[1] + half[5]) + (half[3] + half[7]));
}

// The row's last K % 16 columns, in order, added to the folded sum.
template <DType dtype>
inline float finish_dot(const std::byte* row, const float* x, size_t K16, size_t K, float sum) {
    for (size_t k = K16; k < K; ++k) sum = std::fma(weight_at<dtype>(row, k), x[k], sum);
    return sum;
}

// out[c·N + n] = dot(row n, x + c·K) for c < C and the `rows` rows that start at `weights`, row_bytes apart: each
// weight row against C tokens, one row after the other. The portable kernel and the definition the SIMD ones in
// appendix F reproduce: each weight is converted once and used for all C tokens.
template <DType dtype, int C>
inline void tile_portable(const std::byte* weights, size_t row_bytes, size_t rows, const float* x, size_t K, float* out, size_t N) {
    const size_t K16 = K / 16 * 16;
    for (size_t n = 0; n < rows; ++n) {
        const std::byte* row = weights + n * row_bytes;
        float lanes[C][16] = {};
        for (size_t k = 0; k < K16; k += 16)
            for (int lane = 0; lane < 16; ++lane) {
                const float w = weight_at<dtype>(row, k + lane);
                for (int c = 0; c < C; ++c) lanes[c][lane] = std::fma(w, x[c * K + k + lane], lanes[c][lane]);
            }
        for (int c = 0; c < C; ++c) out[c * N + n] = finish_dot<dtype>(row, x + c * K, K16, K, fold_lanes(lanes[c]));
    }
}

// e^x for attention's softmax weights, where x = a score − its chunk's maximum ≤ 0. Range reduction x = n·ln 2 + r with
// |r| ≤ ln 2 / 2 (ln 2 in two parts, so n·ln 2 loses nothing), e^r by its Taylor polynomial to degree 7 in fused
// multiply-adds (truncation below 1e-8), and 2ⁿ added to the exponent bits: within one ulp of e^x. Below −86 it
// returns 0 (e^−86 ≈ 4e−38, nothing a sum of weights near 1 can see) so 2ⁿ stays a normal number. Written in plain
// float operations because the SIMD twin (appendix F) must give the same bits, which std::exp does not promise.
namespace exp_nonpositive_constants {
constexpr float round_shift = 12582912.0f;  // 1.5 · 2²³: adding it rounds to an integer, kept in the low bits
constexpr uint32_t round_shift_bits = 0x4B400000;
constexpr float log2_e = 1.44269504f, ln2_high = 0.693359375f, ln2_low = -2.12194440e-4f, cutoff = -86.0f;
constexpr float taylor[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 1.0f / 2, 1.0f, 1.0f};  // 1/7! … 1/0!
}  // namespace exp_nonpositive_constants

inline float exp_nonpositive(float x) {
    using namespace exp_nonpositive_constants;
    const float shifted = std::fma(x, log2_e, round_shift);  // round_shift + n, n = round(x / ln 2)
    const float n = shifted - round_shift;
    const float r = std::fma(n, -ln2_low, std::fma(n, -ln2_high, x));
    float p = taylor[0];
    for (int i = 1; i < 8; ++i) p = std::fma(p, r, taylor[i]);
    const uint32_t exponent_step = (std::bit_cast<uint32_t>(shifted) - round_shift_bits) << 23;  // n, two's complement
    return x < cutoff ? 0.0f : std::bit_cast<float>(std::bit_cast<uint32_t>(p) + exponent_step);
}

// The largest of s[0, count). Eight running maxima side by side, element j into lane j % 8: eight independent
// comparisons per step where one chain waited on each previous result (the maximum is the same in any order).
inline float largest(const float* s, int count) {
    float lanes[8];
    std::fill(lanes, lanes + 8, -std::numeric_limits<float>::infinity());
    int j = 0;
    for (; j + 8 <= count; j += 8)
        for (int lane = 0; lane < 8; ++lane) lanes[lane] = std::max(lanes[lane], s[j + lane]);
    for (; j < count; ++j) lanes[j % 8] = std::max(lanes[j % 8], s[j]);
    return *std::max_element(lanes, lanes + 8);
}

// s[j] = exp_nonpositive(s[j] − max) for j in [begin, count), each also added into partial[j % 8]; returns the sum of
// all eight partial sums, in order. Summed this way, weight j into lane j % 8, is how an eight-lane register adds, so
// the SIMD paths (which run the first count − count % 8 weights eight at a time and pass the rest here) give the same
// bits; it is also eight independent additions per step instead of one chain.
inline float softmax_exp_rows_from(float* s, int begin, int count, float max, float (&partial)[8]) {
    for (int j = begin; j < count; ++j) {
        s[j] = exp_nonpositive(s[j] - max);
        partial[j % 8] += s[j];
    }
    float sum = 0.0f;
    for (float lane : partial) sum += lane;
    return sum;
}

// acc[d] += Σ_j weights[j] · rows[j][d] for d < n, j in order (the `count` rows of n values side by side, in the
// cache's type): attention's weighted sum of values. Each element's sum is a chain of fused multiply-adds in j order
// on every path.
template <DType dtype>
inline void add_weighted_rows_portable(float* acc, const std::byte* rows, const float* weights, int count, size_t n) {
    const size_t row_bytes = static_cast<size_t>(dtype_bytes(dtype, static_cast<int64_t>(n)));
    for (int j = 0; j < count; ++j)
        for (size_t d = 0; d < n; ++d) acc[d] = std::fma(weights[j], weight_at<dtype>(rows + j * row_bytes, d), acc[d]);
}

// out = x / sqrt(mean(x²) + eps) · gain. The mean is summed in double, as llama.cpp does, in eight interleaved partial
// sums (element i into sum i % 8, added in order at the end), so the adder is not waiting on one chain, and every path
// and batch gets the same bits. The gain is read in its stored type (f32 in GGUF files, often bf16 in safetensors).
inline void rms_norm(const float* x, const Tensor& gain, size_t width, double eps, float* out) {
    double partial_sums[8] = {};
    size_t i = 0;
    for (; i + 8 <= width; i += 8)
        for (size_t lane = 0; lane < 8; ++lane) partial_sums[lane] += static_cast<double>(x[i + lane]) * x[i + lane];
    for (; i < width; ++i) partial_sums[i % 8] += static_cast<double>(x[i]) * x[i];
    double sum_squares = 0;
    for (double partial : partial_sums) sum_squares += partial;
    const float scale = static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(width) + eps));
    const auto scale_by_gain = [&](auto gain_at) {
        for (size_t k = 0; k < width; ++k) out[k] = x[k] * scale * gain_at(k);
    };
    switch (gain.dtype) {
        case DType::F32: return scale_by_gain([&](size_t k) { return weight_at<DType::F32>(gain.data, k); });
        case DType::BF16: return scale_by_gain([&](size_t k) { return weight_at<DType::BF16>(gain.data, k); });
        case DType::F16: return scale_by_gain([&](size_t k) { return weight_at<DType::F16>(gain.data, k); });
        default: return scale_by_gain([&](size_t k) { return gain.at(static_cast<int64_t>(k)); });
    }
}

// The RoPE angle step of each frequency, with the configured long-context scaling applied.   [Dh/2]
// Low frequencies (long wavelengths) carry position over long distances; scaling them stretches a model's context.
inline std::vector<double> rope_inverse_frequencies(const Model& model) {
    const ModelConfig& c = model.config;
    const int half = c.head_dim / 2;
    const std::vector<double> divisors = rope_frequency_divisors(c);
    std::vector<double> inverse(half);
    for (int i = 0; i < half; ++i) {
        const double freq = 1.0 / std::pow(c.rope_theta, 2.0 * i / c.head_dim);
        inverse[i] = freq / (model.rope_freq_divisors.empty() ? divisors[i] : model.rope_freq_divisors[i]);
    }
    return inverse;
}

// SwiGLU's gate, silu(x) = x · σ(x) with σ(x) = 1 / (1 + e^−x) = e^x / (1 + e^x). With e = e^−|x|, which is at
// most 1 and so overflows on neither side, it is x / (1 + e) for x ≥ 0 and x · e / (1 + e) below. The exponential is
// attention's (exp_nonpositive), plain float operations, so that the SIMD twin (appendix F) gives the same bits.
inline float silu(float x) {
    const float e = exp_nonpositive(-std::fabs(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

// gate[i] = silu(gate[i]) · up[i] for i < count: the MLP's gated activation (eight at a time in the SIMD paths).
inline void swiglu_portable(float* gate, const float* up, size_t count) {
    for (size_t i = 0; i < count; ++i) gate[i] = silu(gate[i]) * up[i];
}
// One product of a matmul call: out[T, N] = x[T, K] · w[N, K]ᵀ (+ bias[N]).
struct Product {
    const Tensor& w;
    float* out;
    const Tensor* bias = nullptr;
};

// The kernels the forward pass calls by path, and the matmul's parts by weight type (appendix F).
inline void swiglu(CpuKernels path, float* gate, const float* up, size_t count);
inline void prefetch_bytes(const std::byte* data, size_t bytes);  // a hint to the memory system, no effect on results
// A parallel section over a batch of T tokens: `count` items, one contiguous range per thread for small batches,
// pieces of `piece` that the threads claim as they finish for large (compute-bound) ones.
template <class Body>
inline void run_for_batch(ThreadPool& pool, int T, size_t count, size_t piece, size_t work, Body&& body);
// The activations of one matmul call in the forms its weights' kernels read (8-bit blocks, bf16), and rows
// [row_begin, row_end) of one product by its weight type; how many rows a thread takes at a time.
struct ActivationForms;
inline const ActivationForms& activation_forms(ThreadPool& pool, const float* x, int T, std::initializer_list<Product> products);
inline void product_rows(CpuKernels path, const Product& p, const float* x, const ActivationForms& forms, int T,
                         size_t row_begin, size_t row_end);
inline size_t matmul_piece(const ThreadPool& pool, size_t total_rows);

// Products that share their input x[T, K] (q, k and v; gate and up) run as one parallel section: their rows are laid
// end to end and split across threads, so each weight row is read from memory once and the pool wakes once.
inline void matmul(ThreadPool& pool, const float* x, int T, std::initializer_list<Product> products) {
    const CpuKernels path = cpu_kernels();
    const ActivationForms& forms = activation_forms(pool, x, T, products);  // the calling thread's, read by all
    size_t total_rows = 0;
    for (const Product& p : products) total_rows += static_cast<size_t>(p.w.rows());
    auto rows = [&](size_t begin, size_t end, int) {
        size_t first_row = 0;  // of the current product, in the concatenated numbering
        for (const Product& p : products) {
            const size_t N = static_cast<size_t>(p.w.rows());
            const size_t from = std::max(begin, first_row), to = std::min(end, first_row + N);
            if (from < to) {
                product_rows(path, p, x, forms, T, from - first_row, to - first_row);
                if (p.bias && !p.bias->empty())
                    for (int t = 0; t < T; ++t)
                        for (size_t n = from - first_row; n < to - first_row; ++n)
                            p.out[static_cast<size_t>(t) * N + n] += p.bias->at(static_cast<int64_t>(n));
            }
            first_row += N;
        }
    };
    const size_t K = static_cast<size_t>(products.begin()->w.cols());
    run_for_batch(pool, T, total_rows, matmul_piece(pool, total_rows), total_rows * K * static_cast<size_t>(T), rows);
}

}  // namespace detail

// ---- The forward pass -----------------------------------------------------------------------------------------------

// Runs batches through a model. Owns the scratch buffers, sized for the largest batch seen so far, so the steady
// state allocates nothing per token.
class ForwardPass {
public:
    ForwardPass(const Model& model, ThreadPool& pool)  // keeps both by reference: they outlive the pass
        : model_(model), pool_(pool), inverse_frequencies_(detail::rope_inverse_frequencies(model)) {}

    const Model& model() const { return model_; }

    // Logits [rows, V] for the tokens whose wants_logits is set, in batch order, against the paged KV cache of
    // section 05 (its tables and its pool: the overload below).
    std::span<const float> forward(const Batch& batch, KVCache& cache);

    // The same against a pool and the block table of each sequence of the batch.
    std::span<const float> forward(const Batch& batch, KVStorage& cache, const BlockTableOf& table_of) {
        const ModelConfig& c = model_.config;
        const int T = static_cast<int>(batch.size());
        if (T == 0) return {};
        if (batch.positions.size() != batch.tokens.size() || batch.sequences.size() != batch.tokens.size() ||
            batch.wants_logits.size() != batch.tokens.size())
            fail("batch: tokens, positions, sequences and wants_logits differ in length");
        const size_t D = c.dim, Dh = c.head_dim, H = c.n_heads, Hkv = c.n_kv_heads, F = c.ffn_dim, V = c.vocab_size;
        const size_t q_width = H * Dh, kv_width = Hkv * Dh;
        resize(static_cast<size_t>(T));  // grows only: the steady state allocates nothing

        // Where each token's K/V go, and the cos/sin of its rotation (shared by all layers and heads).
        for (int t = 0; t < T; ++t) {
            int token = batch.tokens[t], position = batch.positions[t];
            if (token < 0 || token >= c.vocab_size)
                fail("token id ", token, " is outside the vocabulary (", c.vocab_size, " tokens)");
            if (position < 0 || position >= c.context_length)
                fail("position ", position, " is outside the model's context of ", c.context_length, " tokens");
            const std::vector<int>& table = table_of(batch.sequences[t]);
            if (static_cast<size_t>(position / cache.block_size()) >= table.size())
                fail("KV cache: sequence ", batch.sequences[t], " has no block reserved for position ", position);
            slot_block_[t] = table[position / cache.block_size()];
            slot_offset_[t] = position % cache.block_size();
            for (size_t i = 0; i < Dh / 2; ++i) {
                double angle = position * inverse_frequencies_[i];
                rope_cos_[t * (Dh / 2) + i] = static_cast<float>(std::cos(angle));
                rope_sin_[t * (Dh / 2) + i] = static_cast<float>(std::sin(angle));
            }
            model_.embedding.read_row(token, &x_[t * D]);  // the residual stream starts as the token's embedding
        }
        const size_t attention_work = plan_attention(batch);
        const CpuKernels path = cpu_kernels();

        // Each block's input: the residual stream plus the previous block's output (xn_), then normed into xn_. The
        // add rides along with the norm's pass over the row, on every thread.
        auto add_block_and_norm = [&](bool add_block, const Tensor& gain) {
            pool_.run_sized(T, T * D, [&](size_t begin, size_t end, int) {
                for (size_t t = begin; t < end; ++t) {
                    if (add_block)
                        for (size_t i = 0; i < D; ++i) x_[t * D + i] += xn_[t * D + i];
                    detail::rms_norm(&x_[t * D], gain, D, c.norm_eps, &xn_[t * D]);
                }
            });
        };

        for (int l = 0; l < c.n_layers; ++l) {
            const LayerWeights& w = model_.layers[l];
            // Attention block: each token looks at its sequence's earlier tokens through their cached K and V.
            add_block_and_norm(l > 0, w.attn_norm);
            detail::matmul(pool_, xn_.data(), T, {{w.wq, q_.data(), &w.bq}, {w.wk, k_.data(), &w.bk}, {w.wv, v_.data(), &w.bv}});
            pool_.run_sized(T, T * (H + Hkv) * Dh * 4, [&](size_t begin, size_t end, int) {
                for (size_t t = begin; t < end; ++t) {
                    for (size_t h = 0; h < H; ++h) position_heads(&q_[t * q_width + h * Dh], w.q_norm, t);
                    for (size_t h = 0; h < Hkv; ++h) position_heads(&k_[t * kv_width + h * Dh], w.k_norm, t);
                    for (size_t h = 0; h < Hkv; ++h) {
                        const int head = static_cast<int>(h);
                        cache.store_key(l, slot_block_[t], head, slot_offset_[t], &k_[t * kv_width + h * Dh]);
                        cache.store_value(l, slot_block_[t], head, slot_offset_[t], &v_[t * kv_width + h * Dh]);
                    }
                }
            });
            // Items one by one when claimed: causal items differ in size.
            detail::run_for_batch(pool_, T, attention_items_.size(), 1, attention_work, [&](size_t begin, size_t end, int thread) {
                for (size_t item = begin; item < end; ++item) attend(path, batch, cache, table_of, l, item, thread);
            });
            if (attention_items_.size() + 1 > merge_ranges_.size())  // some token's context spans several chunks
                pool_.run_sized(merge_ranges_.size() - 1, attention_items_.size() * H / Hkv * Dh, [&](size_t begin, size_t end, int) {
                    for (size_t tile_head = begin; tile_head < end; ++tile_head) merge_chunks(tile_head);
                });
            detail::matmul(pool_, attn_.data(), T, {{w.wo, xn_.data()}});

            // MLP block: per token, no mixing across positions; two thirds of a layer's weights live here.
            add_block_and_norm(true, w.ffn_norm);
            detail::matmul(pool_, xn_.data(), T, {{w.w_gate, gate_.data()}, {w.w_up, up_.data()}});
            pool_.run_sized(T, T * F * 2, [&](size_t begin, size_t end, int) {  // SwiGLU: an exponential per element
                detail::swiglu(path, &gate_[begin * F], &up_[begin * F], (end - begin) * F);
            });
            detail::matmul(pool_, gate_.data(), T, {{w.w_down, xn_.data()}});
        }

        // The last block's output, the final norm and the vocabulary projection, only for the rows someone will sample
        // from (in order, so a row's normed copy lands where earlier rows' block outputs were already added).
        int rows = 0;
        for (size_t t = 0; t < static_cast<size_t>(T); ++t) {
            if (!batch.wants_logits[t]) continue;
            for (size_t i = 0; i < D; ++i) x_[t * D + i] += xn_[t * D + i];
            detail::rms_norm(&x_[t * D], model_.final_norm, D, c.norm_eps, &xn_[rows++ * D]);
        }
        if (logits_.size() < static_cast<size_t>(rows) * V) logits_.resize(static_cast<size_t>(rows) * V);
        if (rows > 0) detail::matmul(pool_, xn_.data(), rows, {{model_.lm_head, logits_.data()}});
        return {logits_.data(), static_cast<size_t>(rows) * V};
    }

private:
    void resize(size_t T) {
        const ModelConfig& c = model_.config;
        if (T <= capacity_) return;
        capacity_ = T;
        const size_t q_width = static_cast<size_t>(c.n_heads) * c.head_dim, kv_width = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
        x_.resize(T * c.dim);                                              // [T, D] the residual stream
        xn_.resize(T * std::max<size_t>(c.dim, 1));                        // [T, D] normed input / block output
        q_.resize(T * q_width);                                            // [T, H, Dh]
        k_.resize(T * kv_width);                                           // [T, Hkv, Dh]
        v_.resize(T * kv_width);                                           // [T, Hkv, Dh]
        attn_.resize(T * q_width);                                         // [T, H, Dh]
        gate_.resize(T * c.ffn_dim);                                       // [T, F]
        up_.resize(T * c.ffn_dim);                                         // [T, F]
        rope_cos_.resize(T * c.head_dim / 2);                              // [T, Dh/2]
        rope_sin_.resize(T * c.head_dim / 2);                              // [T, Dh/2]
        slot_block_.resize(T);
        slot_offset_.resize(T);
    }

    // Per-head RMSNorm (qwen3), then the rotation by this token's position. RoPE turns each pair of dimensions by an
    // angle proportional to the position, so q·k depends only on how far apart two tokens are.
    void position_heads(float* head, const Tensor& norm, size_t t) {
        const ModelConfig& c = model_.config;
        const size_t Dh = c.head_dim, half = Dh / 2;
        if (!norm.empty()) detail::rms_norm(head, norm, Dh, c.norm_eps, head);
        const float* cos = &rope_cos_[t * half];
        const float* sin = &rope_sin_[t * half];
        for (size_t i = 0; i < half; ++i) {
            size_t a = c.rope_style == RopeStyle::HalfRotation ? i : 2 * i;
            size_t b = c.rope_style == RopeStyle::HalfRotation ? i + half : 2 * i + 1;
            float x0 = head[a], x1 = head[b];
            head[a] = x0 * cos[i] - x1 * sin[i];
            head[b] = x0 * sin[i] + x1 * cos[i];
        }
    }

    // ---- Attention, chunk by chunk ----
    // Each token's query heads look at its sequence's cached keys and values: softmax(q·k / sqrt(Dh)) over the
    // positions it may see (causal, and Mistral's window), then the weighted sum of values. The work is cut into items,
    // so that a long context is spread over the threads too: a tile of up to attention_queries consecutive tokens of one
    // sequence, one KV head with the H / Hkv query heads that share it (GQA), and one chunk of attention_chunk
    // positions. Each item keeps its chunk's maximum score m, the sum l of its weights exp(s − m) and their weighted
    // values; the chunks of a token then merge as an online softmax does (flash decoding), each weighed by
    // exp(its m − the largest m). Chunk edges are fixed positions, so every result is the same bits whatever the batch,
    // the tiling, the block size or the thread count. Cost per token and head: 2·Dh multiply-adds per visible position.
    static constexpr int attention_chunk = 512;   // positions per item
    static constexpr int attention_queries = 8;   // tokens per query tile

    struct QueryTile {
        int first_token, tokens;  // batch tokens [first_token, first_token + tokens): one sequence, positions in a row
    };
    struct AttentionItem {
        int tile, kv_head, first, end;  // positions [first, end) of one chunk that some query of the tile sees
        size_t partial;                 // its per-query max, sum and values in partial_
        bool whole;                     // the tile's only chunk: it writes the outputs itself
    };

    int first_visible(int position) const {
        const int window = model_.config.sliding_window;  // Mistral attends to the latest `window` positions only
        return window > 0 ? std::max(0, position - window + 1) : 0;
    }

    // The query tiles and items of this batch (the same for every layer), with their buffers sized; returns the work
    // in multiply-adds, for the thread pool's sizing. Then one item on `path`'s kernels, and the merge of one tile and
    // KV head's chunks. Appendix F has them: the work split over threads and the kernels' order of operations.
    size_t plan_attention(const Batch& batch);
    void attend(CpuKernels path, const Batch& batch, const KVStorage& cache, const BlockTableOf& table_of, int layer,
                size_t index, int thread);
    template <CpuKernels path>
    void attend_with(const Batch& batch, const KVStorage& cache, const BlockTableOf& table_of, int layer,
                     const AttentionItem& item, int thread);
    void merge_chunks(size_t tile_head);

    const Model& model_;
    ThreadPool& pool_;
    std::vector<double> inverse_frequencies_;  // [Dh/2]
    size_t capacity_ = 0;                      // the largest T the buffers hold
    AlignedVector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, rope_cos_, rope_sin_;  // shapes in resize()
    std::vector<QueryTile> query_tiles_;          // this batch's tokens, in tiles of one sequence's consecutive ones
    std::vector<AttentionItem> attention_items_;  // this batch's attention work: (query tile, KV head, chunk)
    std::vector<size_t> merge_ranges_;            // [tiles · Hkv + 1] where each tile and KV head's items begin
    AlignedVector<float> partial_;                // [items, queries · group, Dh + 2] each chunk's max, sum and values
    AlignedVector<float> scores_;                 // [threads, queries · group, attention_chunk] one chunk's scores
    AlignedVector<float> queries_;                // [threads, queries · group, Dh] one tile's query heads
    std::vector<float> logits_;  // [rows, V] the returned logits
    std::vector<int> slot_block_, slot_offset_;  // [T] where each token's K/V go: block and slot
};

// ---- Structured outputs: a grammar becomes a token mask -------------------------------------------------------------
// A request may ask that its output stay inside a language: any JSON object, the JSON of a schema, the matches of a
// regular expression, one of a list of strings. Each is written as a regular expression over bytes (appendix J turns
// JSON Schemas into one), the expression becomes an automaton whose states are built as outputs reach them (a lazy
// DFA), and each state becomes a token mask: the tokens whose bytes keep the automaton alive from there. The sampler
// sets every other token's logit to -inf before it samples, then steps the automaton through the bytes of the token
// it picked. A state's mask is computed once, by walking a trie of the vocabulary's byte strings from that state and
// pruning a subtree at the first byte the automaton refuses, and every later token and request that reaches the state
// reuses it. Cost: per token, one pass over V to apply the mask; per new state, one walk over the live part of the
// trie (milliseconds for 32k tokens, paid once).

class Grammar;  // appendix J: one compiled language over one vocabulary, shared by the requests that ask for it

namespace detail {
// The grammar's part of sampling (appendix J): the mask for `state` applied to the logits (-inf for every token that
// would leave the language, and for the end ids too where the request ignores EOS), the state after a token (failing
// if the token leaves the language), and whether the output is whole with no byte allowed after it.
inline void mask_logits(const Grammar& grammar, int state, bool ignore_eos, std::span<float> logits);
inline int advance_grammar(const Grammar& grammar, int state, int token);
inline bool grammar_finished(const Grammar& grammar, int state);
}  // namespace detail

// ---- Sampler --------------------------------------------------------------------------------------------------------
// Logits to one token id. Constraints first (logit_bias, then the grammar's mask), then penalties (they change the
// logits), then temperature: 0 is greedy (argmax, ties to
// the lowest id); above 0 the logits are divided by it, then top-k, top-p and min-p trim the candidates and a seeded
// generator draws from what is left. Cost: one pass over V, a sort only of what top-k keeps; microseconds next to
// the forward pass.

struct SamplingParams {
    float temperature = 1.0f;         // 0: greedy
    int top_k = 0;                    // 0: off
    float top_p = 1.0f;               // 1: off
    float min_p = 0.0f;               // 0: off
    float repetition_penalty = 1.0f;  // 1: off; >1 discourages every token seen in the prompt or the output
    float presence_penalty = 0.0f;    // OpenAI's: subtracted once from every token already generated
    float frequency_penalty = 0.0f;   // OpenAI's: subtracted per occurrence in the generated text
    std::optional<uint64_t> seed;     // unset: a random seed (reported so the run can be repeated)
    int max_tokens = 256;
    bool ignore_eos = false;
    int logprobs = -1;  // -1: none; k >= 0: each sampled token's log-probability and the k likeliest (OpenAI, vLLM)
    std::vector<std::pair<int, float>> logit_bias;  // OpenAI's: added to those ids' logits before anything else
    std::shared_ptr<const Grammar> grammar;         // structured outputs: only tokens that keep the output inside it

    // Rejects values no sampler can honour, naming the parameter.
    void validate() const {
        auto bad = [](const char* name, double value, const char* rule) {
            fail("invalid sampling parameter ", name, " = ", value, ": ", rule);
        };
        if (!(temperature >= 0) || !std::isfinite(temperature)) bad("temperature", temperature, "must be a finite number >= 0");
        if (top_k < 0) bad("top_k", top_k, "must be >= 0 (0 turns it off)");
        if (!(top_p > 0 && top_p <= 1)) bad("top_p", top_p, "must be in (0, 1]");
        if (!(min_p >= 0 && min_p <= 1)) bad("min_p", min_p, "must be in [0, 1]");
        if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
            bad("repetition_penalty", repetition_penalty, "must be a finite number > 0 (1 turns it off)");
        if (!(presence_penalty >= -2 && presence_penalty <= 2)) bad("presence_penalty", presence_penalty, "must be in [-2, 2]");
        if (!(frequency_penalty >= -2 && frequency_penalty <= 2)) bad("frequency_penalty", frequency_penalty, "must be in [-2, 2]");
        if (max_tokens < 0) bad("max_tokens", max_tokens, "must be >= 0");
        if (logprobs < -1 || logprobs > max_logprobs) bad("logprobs", logprobs, "must be in [0, 20] (-1 turns it off)");
        for (const auto& [id, bias] : logit_bias) {
            if (id < 0) bad("logit_bias", id, "names a negative token id");
            if (!(bias >= -100 && bias <= 100)) bad("logit_bias", bias, "values must be in [-100, 100]");
        }
    }
    static constexpr int max_logprobs = 20;
};

namespace detail {
// The sampler's random numbers (appendix B): xoshiro256**, seeded through splitmix64, so that the same seed gives the
// same stream on every platform, which std::mt19937 with std::uniform_real_distribution does not promise.
inline void seed_xoshiro(std::array<uint64_t, 4>& state, uint64_t seed);
inline uint64_t next_xoshiro(std::array<uint64_t, 4>& state);
}  // namespace detail

class Sampler {
public:
    Sampler(const SamplingParams& params, int vocab_size) : params_(params), counts_(static_cast<size_t>(vocab_size), 0) {
        params_.validate();
        for (const auto& [id, bias] : params_.logit_bias)
            if (id >= vocab_size) fail("invalid sampling parameter logit_bias: token id ", id, " is outside the vocabulary (", vocab_size, " tokens)");
        seed_ = params.seed ? *params.seed : (static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}());
        detail::seed_xoshiro(rng_, seed_);
    }

    uint64_t seed() const { return seed_; }

    // The prompt, for the repetition penalty; call once before sampling.
    void set_prompt(std::span<const int> prompt) {
        for (int id : prompt)
            if (id >= 0 && static_cast<size_t>(id) < counts_.size()) seen_in_prompt_.push_back(id);
    }
    // Each generated token, for the penalties and the grammar's state.
    void accept(int id) {
        if (id >= 0 && static_cast<size_t>(id) < counts_.size()) {
            if (counts_[id]++ == 0) generated_.push_back(id);
        }
        if (params_.grammar) grammar_state_ = detail::advance_grammar(*params_.grammar, grammar_state_, id);
    }

    // The output is a whole sentence of its grammar and no byte may follow: nothing is left to sample.
    bool grammar_complete() const {
        return params_.grammar && detail::grammar_finished(*params_.grammar, grammar_state_);
    }

    // Picks the next token. `logits` [V] is modified in place.
    int sample(std::span<float> logits) {
        constrain(logits);
        apply_penalties(logits);
        if (params_.temperature == 0) return argmax(logits);
        const size_t kept = keep_candidates(logits);
        double total = 0;
        for (size_t i = 0; i < kept; ++i) total += candidates_[i].probability;
        double target = uniform() * total;
        for (size_t i = 0; i < kept; ++i) {
            target -= candidates_[i].probability;
            if (target < 0) return candidates_[i].id;
        }
        return candidates_[kept - 1].id;
    }

    // The distribution sample() draws from, written out as p [V]: zero outside what top-k, top-p and min-p keep, all
    // of it on the argmax when greedy. Speculative decoding (section 06) weighs a drafted token by p itself rather
    // than by one draw from it. `logits` [V] is modified in place.
    void distribution(std::span<float> logits, std::vector<float>& p) {
        constrain(logits);
        apply_penalties(logits);
        p.assign(logits.size(), 0.0f);
        if (params_.temperature == 0) {
            p[static_cast<size_t>(argmax(logits))] = 1;
            return;
        }
        const size_t kept = keep_candidates(logits);
        double total = 0;
        for (size_t i = 0; i < kept; ++i) total += candidates_[i].probability;
        for (size_t i = 0; i < kept; ++i) p[static_cast<size_t>(candidates_[i].id)] = static_cast<float>(candidates_[i].probability / total);
    }

    // One id drawn from weights w [V] (any non-negative numbers, not all zero), scanning ids in order.
    int draw(std::span<const float> w) {
        double total = 0;
        for (float x : w) total += x;
        double target = uniform() * total;
        int last = 0;
        for (size_t i = 0; i < w.size(); ++i) {
            if (w[i] <= 0) continue;
            last = static_cast<int>(i);
            target -= w[i];
            if (target < 0) return last;
        }
        return last;  // rounding left a sliver of target: the last id with weight
    }

    double uniform() { return static_cast<double>(detail::next_xoshiro(rng_) >> 11) * 0x1.0p-53; }  // [0, 1), 53 bits

private:
    struct Candidate {
        float logit;
        int id;
        double probability = 0;
    };

    // logit_bias, then the grammar's mask: a token outside the language gets -inf, so no later stage can revive it.
    void constrain(std::span<float> logits) {
        for (const auto& [id, bias] : params_.logit_bias) logits[static_cast<size_t>(id)] += bias;
        if (params_.grammar) detail::mask_logits(*params_.grammar, grammar_state_, params_.ignore_eos, logits);
    }

    void apply_penalties(std::span<float> logits) {
        if (params_.repetition_penalty != 1.0f) {  // as Hugging Face and vLLM: shrink positive logits, grow negative
            auto penalize = [&](int id) {
                float& logit = logits[id];
                logit = logit > 0 ? logit / params_.repetition_penalty : logit * params_.repetition_penalty;
            };
            std::vector<char>& done = penalized_;
            done.assign(logits.size(), 0);
            for (int id : seen_in_prompt_)
                if (!done[id]++) penalize(id);
            for (int id : generated_)
                if (!done[id]++) penalize(id);
        }
        if (params_.presence_penalty != 0 || params_.frequency_penalty != 0)
            for (int id : generated_)
                logits[id] -= params_.presence_penalty + params_.frequency_penalty * static_cast<float>(counts_[id]);
    }

    static int argmax(std::span<const float> logits) {  // ties to the lowest id
        int best = 0;
        for (int i = 1; i < static_cast<int>(logits.size()); ++i)
            if (logits[i] > logits[best]) best = i;
        return best;
    }

    // Temperature, then top-k, top-p and min-p: candidates_[0, kept) hold the survivors, likeliest first, with their
    // unnormalized probabilities. Returns kept. Without truncation nothing needs an order: every token with a
    // non-zero probability, in id order, and no sort of V candidates per token (milliseconds at V = 32k).
    size_t keep_candidates(std::span<const float> logits) {
        const int V = static_cast<int>(logits.size());
        candidates_.resize(static_cast<size_t>(V));
        if ((params_.top_k <= 0 || params_.top_k >= V) && params_.top_p >= 1 && params_.min_p <= 0) {
            const float max = *std::max_element(logits.begin(), logits.end());
            size_t kept = 0;
            for (int i = 0; i < V; ++i) {
                const double p = std::exp(static_cast<double>(logits[i] - max) / params_.temperature);
                if (p > 0) candidates_[kept++] = {logits[i] / params_.temperature, i, p};
            }
            if (kept == 0) candidates_[kept++] = {0, argmax(logits), 1.0};  // no finite logit: the argmax rule decides
            return kept;
        }
        for (int i = 0; i < V; ++i) candidates_[i] = {logits[i] / params_.temperature, i};
        auto higher = [](const Candidate& a, const Candidate& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); };
        size_t kept = candidates_.size();
        if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < kept) {
            std::nth_element(candidates_.begin(), candidates_.begin() + params_.top_k, candidates_.end(), higher);
            kept = static_cast<size_t>(params_.top_k);
        }
        std::sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(kept), higher);
        // Softmax over the survivors (the largest logit is first).
        double total = 0;
        for (size_t i = 0; i < kept; ++i) total += candidates_[i].probability = std::exp(candidates_[i].logit - candidates_[0].logit);
        while (kept > 1 && candidates_[kept - 1].probability == 0) --kept;  // masked (-inf) tokens are never drawn
        if (params_.top_p < 1) {  // the smallest head of the distribution whose mass reaches top_p
            double mass = 0;
            size_t i = 0;
            while (i < kept && mass < params_.top_p * total) mass += candidates_[i++].probability;
            kept = std::max<size_t>(1, i);
        }
        if (params_.min_p > 0) {  // drop tokens less likely than min_p × the most likely one
            size_t i = 1;
            while (i < kept && candidates_[i].probability >= params_.min_p * candidates_[0].probability) ++i;
            kept = i;
        }
        return kept;
    }

    SamplingParams params_;
    uint64_t seed_ = 0;
    std::array<uint64_t, 4> rng_{};
    std::vector<int> counts_;          // [V] occurrences in the generated text
    std::vector<int> generated_;       // distinct generated ids
    std::vector<int> seen_in_prompt_;  // prompt ids
    std::vector<char> penalized_;      // [V] scratch
    std::vector<Candidate> candidates_;
    int grammar_state_ = 0;  // the grammar's state after the output so far (0: its start)
};

// ---- One request end to end -----------------------------------------------------------------------------------------
// Tokenize, prefill the prompt in one forward call, then decode one token per step until EOS, max_tokens or the
// context runs out, streaming text as it completes. Every layer is timed, so a user sees where the time went
// (chapter 01). The engine (section 06) runs many of these at once.

// Why a request ended, with OpenAI's names: an end id or a stop string, max_tokens or the context, a cancel, or a
// request that could never run.
enum class FinishReason { Stop, Length, Cancelled, Error };

inline const char* finish_reason_name(FinishReason reason) {
    switch (reason) {
        case FinishReason::Stop: return "stop";
        case FinishReason::Length: return "length";
        case FinishReason::Cancelled: return "cancelled";
        case FinishReason::Error: return "error";
    }
    return "?";
}

struct GenerationResult {
    std::vector<int> prompt_ids;
    std::vector<int> generated_ids;
    std::string text;           // the generated text (without the prompt)
    FinishReason finish_reason = FinishReason::Length;  // Stop (an end id) or Length (max_tokens or the context)
    uint64_t seed = 0;
    LayerTimes times;
};

// Generates from prompt ids; on_text receives the text as it completes (may be empty to skip streaming).
// `tokenizer` streams the text (nullptr: the model's own, when it has one; without one only ids come out).
inline GenerationResult generate_from_ids(const Model& model, ThreadPool& pool, std::vector<int> prompt_ids,
                                          const SamplingParams& params, const std::function<void(std::string_view)>& on_text = {},
                                          const Tokenizer* tokenizer = nullptr) {
    const ModelConfig& c = model.config;
    GenerationResult result;
    result.prompt_ids = std::move(prompt_ids);
    const int prompt_length = static_cast<int>(result.prompt_ids.size());
    if (prompt_length == 0) fail("the prompt is empty: nothing to condition on (add BOS or some text)");
    if (prompt_length >= c.context_length)
        fail("the prompt is ", prompt_length, " tokens, but the model's context holds ", c.context_length,
                     " (", model.source, "); shorten the prompt");
    Sampler sampler(params, c.vocab_size);
    result.seed = sampler.seed();
    sampler.set_prompt(result.prompt_ids);

    // One sequence, so one block table, the pool in order: the cache is sized for exactly this request (64-bit sum:
    // max_tokens may be anything up to INT_MAX).
    const int total = static_cast<int>(std::min<int64_t>(c.context_length, int64_t{prompt_length} + params.max_tokens));
    KVStorage cache(c, (total + 15) / 16, 16);
    std::vector<int> table(static_cast<size_t>((total + 15) / 16));
    std::iota(table.begin(), table.end(), 0);  // its blocks in order: positions [16·i, 16·i + 16) in block i
    const BlockTableOf table_of = [&table](int) -> const std::vector<int>& { return table; };
    ForwardPass forward(model, pool);
    std::optional<Tokenizer> own_tokenizer;
    if (!tokenizer && has_tokenizer(model)) tokenizer = &own_tokenizer.emplace(tokenizer_for(model));
    std::optional<TextStream> stream;
    if (tokenizer) stream.emplace(*tokenizer, result.prompt_ids.back());
    // Stop at the model's EOS ids and at the tokenizer's (a chat model's end-of-turn token, e.g. <|im_end|>), as vLLM.
    std::vector<int> stop_ids = c.eos_ids;
    if (tokenizer) stop_ids.insert(stop_ids.end(), tokenizer->eos_ids().begin(), tokenizer->eos_ids().end());

    // Prefill: the whole prompt in one batch, logits only for its last token (the others' would be thrown away).
    Batch batch;
    for (int i = 0; i < prompt_length; ++i) batch.add(result.prompt_ids[i], i, 0, i == prompt_length - 1);
    std::vector<float> logits(static_cast<size_t>(c.vocab_size));  // [V] a copy: the sampler edits it in place
    // Stops at max_tokens or when prompt + output fill the context (the model knows no later positions).
    for (int position = prompt_length; position < total; ++position) {
        Stopwatch clock;
        std::span<const float> row = forward.forward(batch, cache, table_of);
        (position == prompt_length ? result.times.prefill : result.times.decode) += clock.seconds();
        clock.restart();
        logits.assign(row.begin(), row.end());
        int next = sampler.sample(logits);
        result.times.sample += clock.seconds();
        if (!params.ignore_eos && std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end()) {
            result.finish_reason = FinishReason::Stop;
            break;
        }
        sampler.accept(next);
        result.generated_ids.push_back(next);
        if (stream) {
            clock.restart();
            std::string piece = stream->push(next);
            result.times.detokenize += clock.seconds();
            result.text += piece;
            if (on_text && !piece.empty()) on_text(piece);
        }
        if (sampler.grammar_complete()) {  // the output is whole and nothing may follow it
            result.finish_reason = FinishReason::Stop;
            break;
        }
        batch.clear();
        batch.add(next, position, 0, true);  // decode: the next step reads only the token just sampled
    }
    if (stream) {
        std::string rest = stream->finish();
        result.text += rest;
        if (on_text && !rest.empty()) on_text(rest);
    }
    return result;
}

// Generates from text: tokenizes with the model's vocabulary (BOS first when the vocabulary asks for it).
inline GenerationResult generate(const Model& model, ThreadPool& pool, std::string_view prompt, const SamplingParams& params,
                                 const std::function<void(std::string_view)>& on_text = {}) {
    Stopwatch clock;
    Tokenizer tokenizer = tokenizer_for(model);
    std::vector<int> ids = tokenizer.encode(prompt);
    double tokenize_seconds = clock.seconds();
    GenerationResult result = generate_from_ids(model, pool, std::move(ids), params, on_text, &tokenizer);
    result.times.tokenize = tokenize_seconds;
    return result;
}

// ==== 05 KV CACHE ====================================================================================================
// Section 04's pool of blocks, managed: a sequence takes a block at a time as it grows, so it holds its length rounded
// up to B, not its maximum length. Prefix caching: a full block is named by a hash chained over (its parent block's
// name, its B token ids), so two prompts that start alike share their first blocks (reference counts), and a finished
// request's blocks stay cached until the pool needs them back, least recently used first. A hit skips the prefill of
// those tokens. Cost: a hash per full block and a map lookup per block; nothing next to the forward pass. (chapter 05)

// The paged KV cache: each sequence's block table over one pool (section 04's KVStorage), which it allocates at first
// use, so that an engine whose forward pass keeps its own pool on a GPU, and follows these tables, holds none on the
// host.
class KVCache {
public:
    // dtype: how keys and values are stored, F32 (the default), F16 or BF16.
    KVCache(const ModelConfig& config, int num_blocks, int block_size = 16, DType dtype = DType::F32);
    ~KVCache();
    KVCache(const KVCache&) = delete;
    KVCache& operator=(const KVCache&) = delete;

    // The pool of keys and values, allocated on first use.
    KVStorage& storage() const {
        if (!storage_) storage_ = std::make_unique<KVStorage>(config_, num_blocks_, block_size_, dtype_);
        return *storage_;
    }
    // Writes the whole pool once (KVStorage::touch): its page faults at the start instead of inside the first steps.
    void touch() { storage().touch(); }

    static size_t bytes_per_token(const ModelConfig& c, DType dtype = DType::F32) { return KVStorage::bytes_per_token(c, dtype); }
    // How many blocks a memory budget buys (at least one).
    static int blocks_for_memory(const ModelConfig& c, size_t bytes, int block_size, DType dtype = DType::F32) {
        size_t per_block = bytes_per_token(c, dtype) * static_cast<size_t>(std::max(block_size, 1));
        return static_cast<int>(std::clamp<size_t>(bytes / per_block, 1, std::numeric_limits<int>::max()));
    }

    int block_size() const { return block_size_; }
    int num_blocks() const { return num_blocks_; }
    int capacity_tokens() const { return num_blocks_ * block_size_; }
    DType dtype() const { return dtype_; }
    // One slot's key or value in the pool (KVStorage::key), for code that reads the cache itself.
    std::byte* key(int layer, int block, int kv_head, int slot) { return storage().key(layer, block, kv_head, slot); }
    std::byte* value(int layer, int block, int kv_head, int slot) { return storage().value(layer, block, kv_head, slot); }
    const std::byte* key(int layer, int block, int kv_head, int slot) const { return storage().key(layer, block, kv_head, slot); }
    const std::byte* value(int layer, int block, int kv_head, int slot) const {
        return storage().value(layer, block, kv_head, slot);
    }

    // The blocks of a sequence, in position order: table[i] holds positions [i·B, (i+1)·B).
    const std::vector<int>& block_table(int sequence) const;
    bool has_sequence(int sequence) const;

    // reserve() grows a sequence's table to hold n_tokens positions and returns false, changing nothing, when the pool
    // is out of blocks: an expected outcome the scheduler handles, not an error. release() gives a sequence's blocks
    // back. The rest is prefix caching: a new prompt attaches the cached blocks of its longest already-computed prefix
    // (match_prefix), and computed blocks are named for later prompts (commit).
    bool reserve(int sequence, int n_tokens);
    void release(int sequence);
    void truncate(int sequence, int n_tokens);  // gives back the blocks past n_tokens (rejected speculative tokens)
    int match_prefix(int sequence, std::span<const int> tokens);
    int cached_prefix_tokens(std::span<const int> tokens) const;  // what match_prefix would find, changing nothing
    void commit(int sequence, std::span<const int> tokens, int n_computed);
    void set_prefix_caching(bool on);
    bool prefix_caching() const;
    // The pool's three states: held by a sequence, cached (no holder, still findable by its prefix: reusable, and
    // evictable when the free list runs dry), and free.
    int used_block_count() const { return num_blocks_ - free_block_count() - cached_block_count(); }
    int cached_block_count() const;
    int free_block_count() const;
    int available_block_count() const { return free_block_count() + cached_block_count(); }
    int ref_count(int block) const;  // how many sequences' tables hold the block

private:
    struct BlockManager;

    ModelConfig config_;
    int block_size_, num_blocks_;
    DType dtype_;
    std::unique_ptr<BlockManager> blocks_;
    mutable std::unique_ptr<KVStorage> storage_;
};

// The block manager's state: each block's reference count and name, the free list, the cached blocks in release
// order, and each sequence's table.
struct KVCache::BlockManager {
    struct Block {
        int ref_count = 0;        // sequences whose tables hold it
        bool hashed = false;      // full, computed and findable by hash
        uint64_t hash = 0, parent = 0;
        uint64_t last_used = 0;   // release tick: the LRU order of cached blocks
        std::vector<int> tokens;  // [B] the ids it holds, to confirm a hash match
    };
    struct SequenceBlocks {
        std::vector<int> table;  // block of positions [i·B, (i+1)·B)
        int hashed_blocks = 0;   // table[0, hashed_blocks) are named
        uint64_t last_hash = 0;  // the name of table[hashed_blocks - 1] (0 before the first)
    };

    std::vector<Block> blocks;                      // [num_blocks]
    std::vector<int> free_blocks;
    std::map<uint64_t, int> evictable;              // release tick → cached block nobody holds, oldest first
    std::unordered_map<uint64_t, int> by_hash;      // hash → named block
    std::unordered_map<int, SequenceBlocks> sequences;
    bool prefix_caching = true;
    uint64_t clock = 0;

    // FNV-1a over the parent's hash and the ids, then a final mix: cheap, and chained so a block's name depends on
    // everything before it (the same ids after a different prefix have different K/V).
    static uint64_t hash_block(uint64_t parent, std::span<const int> ids) {
        uint64_t h = 0xcbf29ce484222325ull;
        auto mix = [&h](uint64_t word) {
            for (int byte = 0; byte < 8; ++byte) h = (h ^ ((word >> (8 * byte)) & 0xFF)) * 0x100000001b3ull;
        };
        mix(parent);
        for (int id : ids) mix(static_cast<uint32_t>(id));
        h ^= h >> 33;
        return (h * 0xff51afd7ed558ccdull) | 1;  // never 0: 0 is "no parent"
    }

    // The cached block that holds `ids` after the prefix named `parent`, or -1. The hash names the block; the stored
    // ids prove it (a 64-bit collision would otherwise mix two prompts).
    int find(uint64_t parent, uint64_t hash, std::span<const int> ids) const {
        auto found = by_hash.find(hash);
        if (found == by_hash.end()) return -1;
        const Block& block = blocks[static_cast<size_t>(found->second)];
        if (block.parent != parent || !std::equal(ids.begin(), ids.end(), block.tokens.begin())) return -1;
        return found->second;
    }

    // A free block, else the least recently released cached one (its name is forgotten).
    int take_block() {
        int id;
        if (!free_blocks.empty()) {
            id = free_blocks.back();
            free_blocks.pop_back();
        } else {
            auto oldest = evictable.begin();
            id = oldest->second;
            evictable.erase(oldest);
            Block& block = blocks[static_cast<size_t>(id)];
            by_hash.erase(block.hash);
            block.hashed = false;
            block.tokens.clear();
        }
        blocks[static_cast<size_t>(id)].ref_count = 1;
        return id;
    }
};

inline KVCache::KVCache(const ModelConfig& config, int num_blocks, int block_size, DType dtype)
    : config_(config), block_size_(block_size), num_blocks_(num_blocks), dtype_(dtype),
      blocks_(std::make_unique<BlockManager>()) {
    if (block_size <= 0) fail("KV cache block size must be positive, found ", block_size);
    if (num_blocks <= 0) fail("KV cache needs at least one block, found ", num_blocks);
    if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16)
        fail("KV cache type must be f32, f16 or bf16, found ", dtype_name(dtype));
    blocks_->blocks.resize(static_cast<size_t>(num_blocks_));
    for (int block = num_blocks_ - 1; block >= 0; --block) blocks_->free_blocks.push_back(block);
}

inline KVCache::~KVCache() = default;

inline const std::vector<int>& KVCache::block_table(int sequence) const {
    auto found = blocks_->sequences.find(sequence);
    if (found == blocks_->sequences.end()) fail("KV cache: sequence ", sequence, " has no blocks");
    return found->second.table;
}
inline bool KVCache::has_sequence(int sequence) const { return blocks_->sequences.count(sequence) > 0; }
inline void KVCache::set_prefix_caching(bool on) { blocks_->prefix_caching = on; }
inline bool KVCache::prefix_caching() const { return blocks_->prefix_caching; }
inline int KVCache::cached_block_count() const { return static_cast<int>(blocks_->evictable.size()); }
inline int KVCache::free_block_count() const { return static_cast<int>(blocks_->free_blocks.size()); }
inline int KVCache::ref_count(int block) const { return blocks_->blocks.at(static_cast<size_t>(block)).ref_count; }

// The forward pass of section 04 over the paged cache: its pool and each sequence's table.
inline std::span<const float> ForwardPass::forward(const Batch& batch, KVCache& cache) {
    return forward(batch, cache.storage(), [&cache](int sequence) -> const std::vector<int>& { return cache.block_table(sequence); });
}

// Paging: a sequence takes blocks one at a time as it grows, so the memory it holds is its length rounded up to B
// (chapter 05 measures the waste against reserving a whole context per request).
inline bool KVCache::reserve(int sequence, int n_tokens) {
    std::vector<int>& table = blocks_->sequences[sequence].table;
    size_t needed = static_cast<size_t>((n_tokens + block_size_ - 1) / block_size_);
    if (needed <= table.size()) return true;
    if (needed - table.size() > static_cast<size_t>(available_block_count())) return false;
    while (table.size() < needed) table.push_back(blocks_->take_block());
    return true;
}

// Drops a sequence's hold on its blocks. Named blocks nobody holds become cached; the tail of the sequence is
// released first, so it is evicted first (a prefix is worth more than the tail that depends on it).
inline void KVCache::release(int sequence) {
    BlockManager& m = *blocks_;
    auto found = m.sequences.find(sequence);
    if (found == m.sequences.end()) return;
    const std::vector<int>& table = found->second.table;
    for (auto it = table.rbegin(); it != table.rend(); ++it) {
        BlockManager::Block& block = m.blocks[static_cast<size_t>(*it)];
        if (--block.ref_count > 0) continue;
        if (block.hashed) {
            block.last_used = ++m.clock;
            m.evictable[block.last_used] = *it;
        } else {
            m.free_blocks.push_back(*it);
        }
    }
    m.sequences.erase(found);
}

// The opposite of reserve(): drops the blocks of a sequence's table past the first n_tokens positions, so slots that
// held rejected speculative tokens (section 06) go back to the pool. Their K/V were never named (commit() names only
// computed blocks), and slots past n_tokens in the last kept block are simply written again.
inline void KVCache::truncate(int sequence, int n_tokens) {
    BlockManager& m = *blocks_;
    auto found = m.sequences.find(sequence);
    if (found == m.sequences.end()) return;
    BlockManager::SequenceBlocks& s = found->second;
    const size_t keep = static_cast<size_t>((std::max(n_tokens, 0) + block_size_ - 1) / block_size_);
    if (keep < static_cast<size_t>(s.hashed_blocks)) fail("KV cache: truncating sequence ", sequence, " would cut into its named blocks");
    while (s.table.size() > keep) {
        BlockManager::Block& block = m.blocks[static_cast<size_t>(s.table.back())];
        if (--block.ref_count == 0) m.free_blocks.push_back(s.table.back());
        s.table.pop_back();
    }
}

// Attaches the cached blocks that hold a prefix of `tokens` to a sequence that holds none yet, and returns how many
// tokens they cover (a multiple of B). At most tokens.size() - 1 are taken: the last token is always computed
// again, because the next token's logits come from its forward pass (vLLM does the same).
inline int KVCache::match_prefix(int sequence, std::span<const int> tokens) {
    BlockManager& m = *blocks_;
    BlockManager::SequenceBlocks& s = m.sequences[sequence];
    if (!m.prefix_caching || !s.table.empty() || tokens.empty()) return 0;
    const size_t full_blocks = (tokens.size() - 1) / static_cast<size_t>(block_size_);
    uint64_t parent = 0;
    for (size_t i = 0; i < full_blocks; ++i) {
        std::span<const int> ids = tokens.subspan(i * block_size_, static_cast<size_t>(block_size_));
        uint64_t hash = BlockManager::hash_block(parent, ids);
        int id = m.find(parent, hash, ids);
        if (id < 0) break;
        BlockManager::Block& block = m.blocks[static_cast<size_t>(id)];
        if (block.ref_count++ == 0) m.evictable.erase(block.last_used);
        s.table.push_back(id);
        s.hashed_blocks = static_cast<int>(i + 1);
        s.last_hash = hash;
        parent = hash;
    }
    return s.hashed_blocks * block_size_;
}

// A router asks each instance this to send a prompt where its prefix already is (chapter 09).
inline int KVCache::cached_prefix_tokens(std::span<const int> tokens) const {
    const BlockManager& m = *blocks_;
    if (!m.prefix_caching || tokens.empty()) return 0;
    const size_t full_blocks = (tokens.size() - 1) / static_cast<size_t>(block_size_);
    uint64_t parent = 0;
    size_t matched = 0;
    for (; matched < full_blocks; ++matched) {
        std::span<const int> ids = tokens.subspan(matched * block_size_, static_cast<size_t>(block_size_));
        uint64_t hash = BlockManager::hash_block(parent, ids);
        if (m.find(parent, hash, ids) < 0) break;
        parent = hash;
    }
    return static_cast<int>(matched) * block_size_;
}

// After a forward pass: names the sequence's blocks that are now full and computed (`tokens` are all its ids so
// far, prompt then output; the first n_computed have K/V in the cache), so later requests can find them.
inline void KVCache::commit(int sequence, std::span<const int> tokens, int n_computed) {
    BlockManager& m = *blocks_;
    if (!m.prefix_caching) return;
    BlockManager::SequenceBlocks& s = m.sequences.at(sequence);
    const int full = std::min<int>(n_computed / block_size_, static_cast<int>(s.table.size()));
    for (int i = s.hashed_blocks; i < full; ++i) {
        std::span<const int> ids = tokens.subspan(static_cast<size_t>(i) * block_size_, static_cast<size_t>(block_size_));
        uint64_t hash = BlockManager::hash_block(s.last_hash, ids);
        BlockManager::Block& block = m.blocks[static_cast<size_t>(s.table[i])];
        // Another sequence may have computed the same block in the same step: the first one keeps the name and this
        // copy stays anonymous (freed, not cached, on release).
        if (!block.hashed && !m.by_hash.count(hash)) {
            block.hashed = true;
            block.hash = hash;
            block.parent = s.last_hash;
            block.tokens.assign(ids.begin(), ids.end());
            m.by_hash[hash] = s.table[i];
        }
        s.last_hash = hash;
        s.hashed_blocks = i + 1;
    }
}

// ==== 06 SCHEDULER ===================================================================================================
// Which tokens go into the next forward pass, and the Engine that runs many requests at once. Continuous batching
// (Orca, vLLM, nano-vllm): every step first gives each running sequence its one decode token, then fills what is left
// of the token budget with prefill chunks of sequences still reading their prompt (chunked prefill), admitting waiting
// requests first come, first served. When the KV pool runs dry the most recently admitted sequence is preempted: its
// blocks are released and it waits again, to recompute its prompt and output later (the prefix cache often makes that
// cheap). The static policy, the baseline, admits a batch and runs it to the end before admitting more. A forward pass
// over 64 decode tokens reads the weights once, as one token does: decode throughput grows with the batch until the
// matmuls turn compute-bound. Cost of the scheduling itself: O(sequences) per step. (chapter 06, chapter 08)

// Continuous: admit new requests into any step with room (the default, and what serving engines do). Static: the
// baseline chapter 06 measures it against, a batch at a time.
enum class SchedulePolicy { Continuous, Static };

struct SchedulerConfig {
    SchedulePolicy policy = SchedulePolicy::Continuous;
    int max_batch_tokens = 512;  // tokens per forward pass: bounds a step's latency (and the activations' memory)
    int max_seqs = 64;           // sequences running at once
};

// One request's tokens as the scheduler sees them: the ids so far (prompt, then output) and how many of them have
// their K/V in the cache. tokens.size() - computed == 1 is a decode; more is (the rest of) a prefill.
struct Sequence {
    int id = 0;
    std::vector<int> tokens;  // prompt, then each sampled id: a preempted sequence recomputes all of them
    int prompt_length = 0;
    int computed = 0;         // tokens[0, computed) have K/V in the cache
    int cached_tokens = 0;  // prefix-cache hits at the last admission
    int preemptions = 0;
    int draft = 0;            // the last `draft` ids are a proposer's guesses awaiting verification (speculative decoding)
    int remaining() const { return static_cast<int>(tokens.size()) - computed; }
    bool decoding() const { return remaining() - draft == 1; }  // one real token to compute, plus any drafted ones
    void drop_draft() {
        tokens.resize(tokens.size() - static_cast<size_t>(draft));
        draft = 0;
    }
};

// A run of one sequence's tokens in this step's batch: tokens[start, start + count). `sample` is set when the run
// reaches the sequence's last token, so its logits pick the next one.
struct ScheduledChunk {
    Sequence* sequence;
    int start, count;
    bool sample;
};

// One step's work: the chunks in batch order, and what it cost the queue.
struct SchedulePlan {
    std::vector<ScheduledChunk> chunks;
    int prefill_tokens = 0, decode_tokens = 0;  // decode_tokens counts the drafted ids verified with them
    int draft_tokens = 0;
    int preemptions = 0;
    int prefix_hit_tokens = 0;  // tokens admitted sequences found in the prefix cache
};

// Holds pointers to the sequences it schedules; their owner (the Engine) keeps them alive until remove().
class Scheduler {
public:
    explicit Scheduler(SchedulerConfig config) : config_(config) {
        if (config.max_batch_tokens <= 0) fail("scheduler: max_batch_tokens must be positive, found ", config.max_batch_tokens);
        if (config.max_seqs <= 0) fail("scheduler: max_seqs must be positive, found ", config.max_seqs);
    }

    const SchedulerConfig& config() const { return config_; }
    void add(Sequence* sequence) { waiting_.push_back(sequence); }
    bool empty() const { return waiting_.empty() && running_.empty(); }
    size_t waiting_count() const { return waiting_.size(); }
    size_t running_count() const { return running_.size(); }
    const std::vector<Sequence*>& running() const { return running_; }

    // Forgets a finished or cancelled sequence (its blocks are the caller's to release).
    void remove(const Sequence* sequence) {
        std::erase(running_, sequence);
        std::erase(waiting_, sequence);
    }

    // The next step's plan. It also reserves the KV blocks each chunk will write, so the forward pass never runs out.
    SchedulePlan schedule(KVCache& cache) {
        SchedulePlan plan;
        int budget = config_.max_batch_tokens;  // tokens left for this step
        // Decode tokens first: a running sequence waits at most one step for its next token. Then the partial prefills.
        for (int pass = 0; pass < 2; ++pass) {
            for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
                Sequence* s = running_[i];
                if ((pass == 0) != s->decoding() || planned(plan, s)) continue;
                int count = std::min(s->remaining(), budget);
                // A draft that does not fit the budget is cut short: its tail would only be verified next step.
                if (s->draft > 0 && count < s->remaining()) {
                    s->draft -= s->remaining() - count;
                    s->tokens.resize(static_cast<size_t>(s->computed + count));
                }
                if (!make_room(cache, plan, budget, s, s->computed + count)) continue;  // s itself was preempted
                budget -= count;
                add_chunk(plan, s, count);
                i = index_of(s);  // preemptions may have shifted the list
            }
        }
        // Admissions. Continuous: while the budget lasts. Static: only into an empty batch, then that batch runs to
        // its end (its members get prefill chunks in later steps if this one's budget is spent).
        const bool admit = config_.policy == SchedulePolicy::Continuous || running_.empty();
        while (admit && !waiting_.empty() && static_cast<int>(running_.size()) < config_.max_seqs &&
               (budget > 0 || config_.policy == SchedulePolicy::Static)) {
            Sequence* s = waiting_.front();
            int hit = cache.match_prefix(s->id, s->tokens);  // a cached prefix is already computed: skip its prefill
            s->computed = hit;
            int count = std::min(s->remaining(), budget);
            // A new sequence never preempts a running one: if its blocks are not there, it waits (first come, first
            // served: nobody behind it jumps the queue).
            if (!cache.reserve(s->id, s->computed + count)) {
                cache.release(s->id);
                s->computed = 0;
                break;
            }
            waiting_.pop_front();
            running_.push_back(s);
            s->cached_tokens = hit;
            plan.prefix_hit_tokens += hit;
            if (count > 0) {
                budget -= count;
                add_chunk(plan, s, count);
            }
        }
        for (Sequence* s : running_)  // a decode the budget left out this step drafts afresh next step
            if (s->draft > 0 && !planned(plan, s)) s->drop_draft();
        return plan;
    }

private:
    // Whether s already has a chunk this step (a sequence appears at most once in a batch).
    static bool planned(const SchedulePlan& plan, const Sequence* s) {
        return std::any_of(plan.chunks.begin(), plan.chunks.end(), [&](const ScheduledChunk& c) { return c.sequence == s; });
    }
    size_t index_of(const Sequence* s) const {
        return static_cast<size_t>(std::find(running_.begin(), running_.end(), s) - running_.begin());
    }

    // The chunk samples only if it reaches the sequence's last token: a partial prefill has nothing to sample yet.
    void add_chunk(SchedulePlan& plan, Sequence* s, int count) {
        bool sample = s->computed + count == static_cast<int>(s->tokens.size());
        plan.chunks.push_back({s, s->computed, count, sample});
        (s->decoding() ? plan.decode_tokens : plan.prefill_tokens) += count;
        plan.draft_tokens += s->draft;
    }

    // Reserves blocks for s up to n_tokens, preempting the most recently admitted sequences until they fit. Returns
    // false when s itself had to go.
    bool make_room(KVCache& cache, SchedulePlan& plan, int& budget, Sequence* s, int n_tokens) {
        while (!cache.reserve(s->id, n_tokens)) {
            Sequence* victim = running_.back();
            preempt(cache, plan, budget, victim);
            if (victim == s) return false;
        }
        return true;
    }

    void preempt(KVCache& cache, SchedulePlan& plan, int& budget, Sequence* victim) {
        // A victim already planned this step gives its tokens back.
        for (auto it = plan.chunks.begin(); it != plan.chunks.end(); ++it) {
            if (it->sequence != victim) continue;
            budget += it->count;
            (victim->decoding() ? plan.decode_tokens : plan.prefill_tokens) -= it->count;
            plan.draft_tokens -= victim->draft;
            plan.chunks.erase(it);
            break;
        }
        victim->drop_draft();  // a preempted sequence recomputes only what was verified
        std::erase(running_, victim);
        cache.release(victim->id);
        victim->computed = 0;
        ++victim->preemptions;
        ++plan.preemptions;
        waiting_.push_front(victim);  // first in line again: it was admitted before everyone still waiting
    }

    SchedulerConfig config_;
    std::deque<Sequence*> waiting_;   // first come, first served; a preempted sequence goes back to the front
    std::vector<Sequence*> running_;  // in admission order: the back is preempted first
};

// ---- Speculative decoding -------------------------------------------------------------------------------------------
// Decode is memory-bound (chapter 07): a step that checks k + 1 tokens of one sequence reads the weights once, as a
// one-token step does, and costs little more. So a cheap proposer guesses the next k tokens; the target model runs
// them as extra query rows of that sequence in its next step, which gives k + 1 rows of logits at once, and keeps the
// longest run of guesses its own sampler agrees with, plus one token of its own from the first row that disagrees (or
// the row after the last guess). With acceptance rate α per guess a step yields (1 − α^(k+1)) / (1 − α) tokens
// instead of 1 (Leviathan et al. 2023, Chen et al. 2023; vLLM's spec_decode). Exact: greedy keeps a guess only when
// it is the argmax; sampling keeps guess x with probability min(1, p(x)/q(x)) and otherwise draws from
// normalize(max(0, p − q)), which leaves every token's probability p (the proof: chapter 06). Rejected guesses cost
// their slots in the KV cache until the sequence is rolled back: Sequence::tokens and computed trimmed, surplus blocks
// freed (KVCache::truncate), and only verified blocks are ever named for the prefix cache.

enum class SpecMethod { None, Ngram, Draft };

inline const char* spec_method_name(SpecMethod method) {
    switch (method) {
        case SpecMethod::None: return "none";
        case SpecMethod::Ngram: return "ngram";
        case SpecMethod::Draft: return "draft";
    }
    return "?";
}

// "none", "ngram" or "draft" (as --spec takes them).
inline SpecMethod parse_spec_method(std::string_view text) {
    if (text == "none") return SpecMethod::None;
    if (text == "ngram") return SpecMethod::Ngram;
    if (text == "draft") return SpecMethod::Draft;
    fail("unknown speculative method '", text, "': expected ngram, draft or none");
}

// One sequence's turn at the proposer: what it has so far and how far it may guess. The proposer fills `draft` (at
// most max_tokens ids, possibly none) and `q`, the distribution each id was drawn from ([draft.size(), V]); an empty
// q says each id was chosen with certainty (one-hot), as a lookup or a greedy draft model does.
struct DraftRequest {
    int sequence = 0;
    std::span<const int> tokens;  // prompt + output so far, every id verified
    int max_tokens = 0;
    const SamplingParams* params = nullptr;  // the request's; a draft model samples q with them
    uint64_t seed = 0;                       // the request's seed, so a seeded run drafts the same way again
    std::vector<int> draft;
    std::vector<float> q;
};

// What guesses tokens. propose() is called once per step for all the sequences about to decode; forget() when a
// sequence ends, so a proposer that keeps state per sequence (a draft model's KV cache) can drop it.
class Proposer {
public:
    virtual ~Proposer() = default;
    virtual void propose(std::span<DraftRequest> requests) = 0;
    virtual void forget(int /*sequence*/) {}
};

// Prompt lookup (n-gram) decoding: find the most recent earlier place where the last n ids occurred, and guess the k
// ids that followed it there; no match for n, try n − 1, down to 1. No second model and no memory, and on text that
// copies from its context (code edits, summaries that quote, repeated passages) most guesses hold. Cost: a backwards
// scan of the sequence per step, microseconds.
class NgramProposer : public Proposer {
public:
    explicit NgramProposer(int n = 3) : n_(n) {
        if (n < 1) fail("speculative decoding: the n-gram length must be at least 1, found ", n);
    }
    void propose(std::span<DraftRequest> requests) override {
        for (DraftRequest& r : requests) {
            r.draft = lookup(r.tokens, n_, r.max_tokens);
            r.q.clear();  // one-hot: a lookup is certain of its guess
        }
    }
    // The k ids that followed the most recent earlier match of the longest suffix (at most n ids) that has one. The
    // copy may run past the end of the text into its own guesses, as an LZ77 copy does: after "a b a b" the match of
    // "a b" at 0 guesses "a b a b ..." for any k, so text that repeats a short cycle is guessed k ids at a time.
    static std::vector<int> lookup(std::span<const int> tokens, int n, int k) {
        const int length = static_cast<int>(tokens.size());
        for (int m = std::min(n, length - 1); m >= 1 && k > 0; --m) {
            std::span<const int> suffix = tokens.last(static_cast<size_t>(m));
            for (int start = length - m - 1; start >= 0; --start)  // most recent first; the suffix itself excluded
                if (std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) {
                    std::vector<int> draft;
                    for (int at = start + m; static_cast<int>(draft.size()) < k; ++at)
                        draft.push_back(at < length ? tokens[static_cast<size_t>(at)] : draft[static_cast<size_t>(at - length)]);
                    return draft;
                }
        }
        return {};
    }

private:
    int n_;
};

// A smaller model with the same vocabulary drafts k tokens one at a time, all sequences in one batch per token, with
// its own paged KV cache. It keeps what it computed for each sequence and, at the next call, rolls back to the longest
// prefix the target kept, so a step costs the draft model 1 + k small forward passes (the first also catches up on the
// target's own token). q is the draft's distribution under the request's temperature and truncation (penalties are
// left to the target: any q keeps the output exact, a closer one only keeps more guesses).
class DraftModelProposer : public Proposer {
public:
    // `model` must outlive the proposer; `num_blocks` × `block_size` tokens of KV cache for the drafts.
    DraftModelProposer(const Model& model, ThreadPool& pool, int num_blocks, int block_size)
        : model_(model), forward_(model, pool), cache_(model.config, num_blocks, block_size) {
        cache_.set_prefix_caching(false);  // positions are rewritten on rollback; nothing here is shared
    }

    void propose(std::span<DraftRequest> requests) override {
        const int context = model_.config.context_length;
        const size_t V = static_cast<size_t>(model_.config.vocab_size);
        std::vector<int> limit(requests.size(), 0);  // [requests] how many ids each may still draft
        std::vector<size_t> active;                  // requests with a row in the next batch, in batch order
        batch_.clear();
        for (size_t i = 0; i < requests.size(); ++i) {
            DraftRequest& r = requests[i];
            r.draft.clear();
            r.q.clear();
            const int n = static_cast<int>(r.tokens.size());
            // Drafts 1..k−1 are fed back at positions n..n+k−2: the draft's context must hold them.
            limit[i] = std::min(r.max_tokens, context - n + 1);
            if (n == 0 || n > context || limit[i] <= 0 || !room_for(r.sequence, n + limit[i] - 1, requests)) continue;
            State& state = states_[r.sequence];
            // Roll back to what is still true: the longest common prefix, less the last id, whose logits are needed.
            int kept = 0;
            while (kept < state.computed && kept < n - 1 && state.tokens[kept] == r.tokens[kept]) ++kept;
            state.tokens.assign(r.tokens.begin(), r.tokens.end());
            for (int p = kept; p < n; ++p) batch_.add(r.tokens[p], p, r.sequence, p == n - 1);
            if (!state.sampler) {
                SamplingParams params = *r.params;
                params.repetition_penalty = 1;
                params.presence_penalty = params.frequency_penalty = 0;
                params.seed = r.seed ^ 0x9E3779B97F4A7C15ull;  // its own stream, fixed by the request's seed
                params.grammar.reset();  // the target's sampler masks; the draft's guesses are verified against it
                params.logit_bias.clear();
                state.sampler.emplace(params, model_.config.vocab_size);
            }
            active.push_back(i);
        }
        while (!active.empty()) {  // one forward pass per drafted position, all sequences together
            std::span<const float> logits = forward_.forward(batch_, cache_);
            batch_.clear();
            std::vector<size_t> next;
            for (size_t row = 0; row < active.size(); ++row) {
                DraftRequest& r = requests[active[row]];
                State& state = states_[r.sequence];
                state.computed = static_cast<int>(state.tokens.size());
                row_.assign(logits.begin() + static_cast<std::ptrdiff_t>(row * V), logits.begin() + static_cast<std::ptrdiff_t>((row + 1) * V));
                int id;
                if (r.params->temperature == 0) {
                    id = state.sampler->sample(row_);  // greedy: the argmax, q one-hot
                } else {
                    state.sampler->distribution(row_, q_);
                    id = state.sampler->draw(q_);
                    r.q.insert(r.q.end(), q_.begin(), q_.end());
                }
                r.draft.push_back(id);
                if (static_cast<int>(r.draft.size()) < limit[active[row]]) {  // feed it back for the next guess
                    state.tokens.push_back(id);
                    batch_.add(id, static_cast<int>(state.tokens.size()) - 1, r.sequence, true);
                    next.push_back(active[row]);
                }
            }
            active = std::move(next);
        }
    }

    void forget(int sequence) override {
        cache_.release(sequence);
        states_.erase(sequence);
    }

private:
    struct State {
        std::vector<int> tokens;  // what the draft's cache was fed for this sequence
        int computed = 0;         // tokens[0, computed) have K/V in the draft's cache
        std::optional<Sampler> sampler;
    };

    // Blocks for n_tokens positions of `sequence`. A full pool first drops sequences not drafting this step (preempted
    // ones recompute); still full, this sequence drafts nothing this step: an expected outcome, not an error.
    bool room_for(int sequence, int n_tokens, std::span<const DraftRequest> requests) {
        if (cache_.reserve(sequence, n_tokens)) return true;
        for (auto it = states_.begin(); it != states_.end();) {
            bool drafting = std::any_of(requests.begin(), requests.end(), [&](const DraftRequest& r) { return r.sequence == it->first; });
            if (drafting) {
                ++it;
                continue;
            }
            cache_.release(it->first);
            it = states_.erase(it);
        }
        return cache_.reserve(sequence, n_tokens);
    }

    const Model& model_;
    ForwardPass forward_;
    KVCache cache_;
    std::unordered_map<int, State> states_;
    Batch batch_;
    std::vector<float> row_, q_;  // [V] scratch: a row of logits, a row of q
};

// The settings of speculative decoding. `draft_model` is shared, so engines serving side by side draft with one copy;
// `proposer`, when set, replaces the built-in ones (tests plug in their own) and belongs to one engine.
struct SpecConfig {
    SpecMethod method = SpecMethod::None;
    int k = 4;      // ids drafted per sequence per step
    int ngram = 3;  // prompt lookup: the longest suffix matched
    std::shared_ptr<const Model> draft_model;
    std::shared_ptr<Proposer> proposer;
    bool enabled() const { return method != SpecMethod::None || proposer != nullptr; }
};

// The verification of one drafted id against the target's logits (`logits` [V], edited in place). Returns the id to
// emit: `drafted` when kept, otherwise a replacement drawn from the residual max(0, p − q). q is the distribution
// `drafted` came from ([V]; empty: one-hot on it). The sampler's penalties, temperature and truncation shape p, and its
// generator makes the decision, so a seeded request repeats itself.
inline int verify_draft_token(Sampler& sampler, std::span<float> logits, int drafted, std::span<const float> q,
                              std::vector<float>& p) {
    sampler.distribution(logits, p);
    const double q_drafted = q.empty() ? 1.0 : q[static_cast<size_t>(drafted)];
    if (sampler.uniform() * q_drafted < p[static_cast<size_t>(drafted)]) return drafted;  // kept: min(1, p/q)
    double residual_mass = 0;  // p − q, negatives clipped: the mass q under-proposed
    for (size_t i = 0; i < p.size(); ++i) {
        const double qi = q.empty() ? (static_cast<int>(i) == drafted ? 1.0 : 0.0) : q[i];
        p[i] = static_cast<float>(std::max(0.0, p[i] - qi));
        residual_mass += p[i];
    }
    // p ≤ q everywhere means p = q, where rejection has probability 0: only rounding gets here, and keeping is right.
    return residual_mass > 0 ? sampler.draw(p) : drafted;
}

// ---- Where the forward pass runs ------------------------------------------------------------------------------------
// The CPU forward pass of section 04, or the CUDA kernels of infer_cuda.cu behind the same interface (section 07).

enum class Device { Cpu, Cuda };

inline const char* device_name(Device device) { return device == Device::Cuda ? "cuda" : "cpu"; }

// "cpu" or "cuda" (as --device takes them).
inline Device parse_device(std::string_view text) {
    if (text == "cpu") return Device::Cpu;
    if (text == "cuda") return Device::Cuda;
    fail("unknown device '", text, "': expected cpu or cuda");
}

// Settings of the CUDA forward pass (the CPU ignores them).
struct CudaOptions {
    enum class Matmul { Cublas, Tiled };
    Matmul matmul = Matmul::Cublas;  // products of more than vector_rows rows: cuBLAS (fast) or the readable wmma kernel
    int vector_rows = 8;             // products of at most this many rows: the matrix-vector kernel, activations in f32
    int prefill_attention_rows = 16; // runs of at least this many tokens of one sequence: the tiled prefill attention
    bool graphs = true;              // replay decode steps from CUDA graphs, one per batch-size bucket
    int device = 0;                  // the CUDA device's ordinal
};

#ifdef INFER_CUDA
namespace cuda {
class ForwardPass;  // infer_cuda.cu; section 07 declares it
}
#endif

// One forward pass on the chosen device: what the Engine holds. The CPU path is section 04's ForwardPass, untouched (one
// predictable branch per step); the CUDA one is built only when asked for, and asking without it is an error. Its
// constructor and the dispatch are section 07.
class DeviceForwardPass {
public:
    DeviceForwardPass(const Model& model, ThreadPool& pool, Device device = Device::Cpu, CudaOptions options = {});
    ~DeviceForwardPass();
    DeviceForwardPass(const DeviceForwardPass&) = delete;
    DeviceForwardPass& operator=(const DeviceForwardPass&) = delete;

    Device device() const { return device_; }
    const Model& model() const { return cpu_.model(); }
    std::span<const float> forward(const Batch& batch, KVCache& cache);

private:
    ForwardPass cpu_;
    Device device_;
#ifdef INFER_CUDA
    std::unique_ptr<cuda::ForwardPass> cuda_;
#endif
};

// ---- Engine ---------------------------------------------------------------------------------------------------------
// add_request() queues a request; each step() asks the scheduler for a batch, runs one forward pass over it, samples
// each sequence that reached its last token with that request's own sampler, turns the ids into text (holding back
// what could be the start of a stop string) and returns what happened as events. EngineLoop runs step() on its own
// thread for callers on others (the server's HTTP threads).

// How the engine is built: its scheduler, its KV pool and its device. Defaults suit one model on one machine.
struct EngineConfig {
    SchedulerConfig scheduler;
    int block_size = 16;           // B: smaller wastes less of a sequence's last block, larger means shorter tables
    int num_blocks = 0;            // the KV pool in blocks; 0: from kv_memory_bytes
    size_t kv_memory_bytes = 0;    // 0 (and num_blocks 0): room for max_seqs full contexts, at most 1 GiB
    DType kv_dtype = DType::F32;   // how the pool stores K and V: F32, or F16/BF16 for half the bytes (CPU only)
    bool prefix_caching = true;    // off: every prompt is prefilled in full (chapter 05 measures the difference)
    bool touch_kv_pool = false;    // write the whole pool once at the start (KVCache::touch)
    Device device = Device::Cpu;   // where the forward pass runs (section 07); the rest of the engine is the same
    CudaOptions cuda;              // with Device::Cuda
    SpecConfig spec;               // speculative decoding: off unless a method (or a proposer) is set
    size_t step_history = 2048;    // StepStats that steps() keeps: at least the latest this many; 0 keeps every step
};

// A sampled token's log-probability under the model's own distribution (log-softmax of the raw logits, before
// penalties, temperature and truncation, as vLLM reports by default), and the `top` likeliest ids with theirs.
struct TokenLogprob {
    int id = 0;
    float logprob = 0;
    std::vector<std::pair<int, float>> top;  // likeliest first
};

inline TokenLogprob token_logprob(std::span<const float> logits, int id, int top) {
    double max = -std::numeric_limits<double>::infinity();
    for (float l : logits) max = std::max(max, static_cast<double>(l));
    double sum = 0;
    for (float l : logits) sum += std::exp(static_cast<double>(l) - max);
    const double log_total = max + std::log(sum);
    TokenLogprob result;
    result.id = id;
    result.logprob = static_cast<float>(logits[static_cast<size_t>(id)] - log_total);
    std::vector<int> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    const size_t k = std::min(static_cast<size_t>(std::max(top, 0)), ids.size());
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), [&](int a, int b) {
        return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] || (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
    });
    for (size_t i = 0; i < k; ++i) result.top.emplace_back(ids[i], static_cast<float>(logits[static_cast<size_t>(ids[i])] - log_total));
    return result;
}

// What one step did to one request: the ids it produced, the text they completed, and whether it finished.
struct Event {
    int request_id = 0;
    std::vector<int> token_ids;  // new ids (a stop id is not among them)
    std::vector<TokenLogprob> logprobs;  // one per id in token_ids, when the request asked for them
    std::string text;            // new text (held-back text comes later, or never if it turns out to be a stop string)
    bool finished = false;
    FinishReason finish_reason = FinishReason::Length;  // when finished
    std::string error;           // when finish_reason is Error: why
};

// Where one request's time went, in seconds: waiting (in the queue, or running but left out of a step), and its share
// of the steps it was part of. A step is attributed whole to each of its requests, since each waits for all of it; its
// forward time counts as prefill until the request's first token and as decode after. The parts sum to finished -
// arrival, so a benchmark can name the layer that dominates.
struct RequestBreakdown {
    double queue = 0, schedule = 0, prefill = 0, decode = 0, sample = 0, detokenize = 0;
    double total() const { return queue + schedule + prefill + decode + sample + detokenize; }
};

// Times in seconds since the engine was made (steady clock).
struct RequestTimes {
    double arrival = -1, first_scheduled = -1, first_token = -1, finished = -1;
    std::vector<double> token_times;  // [generated] when each id was sampled
    RequestBreakdown breakdown;
};

// Everything a finished request leaves behind; take_result() hands it over once.
struct RequestResult {
    int id = 0;
    std::vector<int> prompt_ids, generated_ids;
    std::vector<TokenLogprob> logprobs;  // one per generated id, when the request asked for them
    std::string text;            // the output text, ending before a matched stop string
    FinishReason finish_reason = FinishReason::Length;
    std::string error;           // why, when finish_reason is Error
    uint64_t seed = 0;           // the sampler's seed: given, or drawn and reported so the run can be repeated
    int cached_tokens = 0;       // prompt tokens found in the prefix cache at the last admission
    int preemptions = 0;
    int draft_tokens = 0, accepted_tokens = 0;  // speculative decoding: ids proposed, and kept by verification
    int draft_steps = 0;                        // steps that verified a draft (tokens per such step: chapter 06)
    RequestTimes times;
};

// What one step cost and what the pool looked like after it.
struct StepStats {
    double start = 0, schedule = 0, forward = 0, sample = 0, detokenize = 0;  // start: seconds since the engine began
    double draft = 0;  // the proposer's share of `schedule`
    int prefill_tokens = 0, decode_tokens = 0, sequences = 0, preemptions = 0, prefix_hit_tokens = 0;
    int draft_tokens = 0, accepted_tokens = 0;  // speculative ids verified in this step, and kept
    int blocks_used = 0, blocks_free = 0, blocks_cached = 0;
};

// Totals over the engine's life, for a summary line.
struct EngineTotals {
    int64_t steps = 0, prefill_tokens = 0, decode_tokens = 0, preemptions = 0, prompt_tokens = 0, prefix_hit_tokens = 0;
    int64_t draft_tokens = 0, accepted_tokens = 0;  // speculative decoding (vLLM's spec_decode_num_*_tokens)
};

class Engine {
public:
    // `tokenizer` streams text and encodes string prompts (nullptr: the model's own, when it has one; without one
    // only ids come out, and stop strings are refused). The engine keeps references to `model` and `pool`, which
    // must outlive it, and its own copy of the tokenizer.
    Engine(const Model& model, ThreadPool& pool, EngineConfig config = {}, const Tokenizer* tokenizer = nullptr)
        : model_(model), config_(config), forward_(model, pool, config.device, config.cuda), scheduler_(config.scheduler),
          cache_(model.config, pool_blocks(model.config, config), config.block_size, config.kv_dtype) {
        // The GPU keeps its own f32 pool and reads only the block tables from this one, so another type would be ignored.
        if (config.device == Device::Cuda && config.kv_dtype != DType::F32)
            fail("KV cache type ", dtype_name(config.kv_dtype), " runs on the CPU only; the CUDA forward pass keeps K and V in f32");
        cache_.set_prefix_caching(config.prefix_caching);
        if (config.touch_kv_pool) cache_.touch();
        if (tokenizer) tokenizer_ = *tokenizer;
        else if (has_tokenizer(model)) tokenizer_ = tokenizer_for(model);
        stop_ids_ = model.config.eos_ids;
        if (tokenizer_) stop_ids_.insert(stop_ids_.end(), tokenizer_->eos_ids().begin(), tokenizer_->eos_ids().end());
        logits_.resize(static_cast<size_t>(model.config.vocab_size));
        proposer_ = make_proposer(config.spec, pool);
    }

    const KVCache& cache() const { return cache_; }
    int waiting_count() const { return static_cast<int>(scheduler_.waiting_count()); }  // queued, not yet admitted
    int running_count() const { return static_cast<int>(scheduler_.running_count()); }  // in the running batch
    const EngineConfig& config() const { return config_; }
    const Model& model() const { return model_; }
    const std::optional<Tokenizer>& tokenizer() const { return tokenizer_; }

    // Queues a request and returns its id. A request that can never run (empty prompt, prompt + max_tokens beyond the
    // context, more blocks than the whole pool, a bad parameter) is not thrown back: the next step() reports it as an
    // Error event whose message names the sizes, as a server answers one bad request without stopping.
    int add_request(std::vector<int> prompt_ids, const SamplingParams& params, std::vector<std::string> stop = {}) {
        auto request = std::make_unique<Request>();
        Request& r = *request;
        r.seq.id = next_id_++;
        r.seq.prompt_length = static_cast<int>(prompt_ids.size());
        r.seq.tokens = std::move(prompt_ids);
        r.params = params;
        r.stop = std::move(stop);
        r.times.arrival = r.accounted_until = now();
        std::string problem = check(r);
        if (problem.empty()) {
            r.sampler.emplace(params, model_.config.vocab_size);
            r.sampler->set_prompt(r.seq.tokens);
            if (tokenizer_) r.stream.emplace(*tokenizer_, r.seq.tokens.back());
            totals_.prompt_tokens += r.seq.prompt_length;
        }
        const int id = r.seq.id;
        requests_[id] = std::move(request);
        if (!problem.empty()) finish_later(id, FinishReason::Error, problem);
        else if (params.max_tokens == 0) finish_later(id, FinishReason::Length, "");
        else scheduler_.add(&requests_[id]->seq);
        return id;
    }
    // Text prompts are encoded with the engine's tokenizer (BOS as the tokenizer adds it).
    int add_request(std::string_view prompt, const SamplingParams& params, std::vector<std::string> stop = {}) {
        if (!tokenizer_) fail(model_.source, ": the engine has no tokenizer to encode a text prompt; pass token ids");
        return add_request(tokenizer_->encode(prompt), params, std::move(stop));
    }

    // Stops a request at the next step: its blocks go back to the pool and it finishes as Cancelled.
    // Unknown or finished ids are ignored (the request may have finished meanwhile).
    void cancel(int id) {
        auto found = requests_.find(id);
        if (found != requests_.end() && !found->second->done) cancelled_.push_back(id);
    }

    bool has_work() const { return !scheduler_.empty() || !pending_finish_.empty() || !cancelled_.empty(); }

    // One step of the engine, in four parts: schedule → forward → sample → emit. Returns what happened to each request.
    std::vector<Event> step() {
        std::vector<Event> events;
        StepStats stats;
        stats.start = now();
        Stopwatch clock;
        finish_waiting(events);  // cancelled requests, and ones refused by add_request, end before anything runs

        // Schedule: which tokens of which sequences go into this forward pass (and who is preempted to make room),
        // after the proposer, if any, has appended its guesses to the sequences about to decode.
        propose(stats);
        SchedulePlan plan = scheduler_.schedule(cache_);
        fill_batch(plan, stats.start);
        stats.schedule = clock.seconds();

        // Forward: one pass over the whole batch, logits only for the rows that sample.
        clock.restart();
        std::span<const float> logits = forward_.forward(batch_, cache_);
        stats.forward = clock.seconds();

        // Sample and emit: each sequence that reached its last token gets its next id, its text and an event.
        sample_and_emit(plan, logits, stats, events);
        record(plan, stats);
        return events;
    }

    // A finished request's result, handed over once (the engine then forgets the request).
    std::optional<RequestResult> take_result(int id) {
        auto found = requests_.find(id);
        if (found == requests_.end() || !found->second->done) return std::nullopt;
        RequestResult result = std::move(found->second->result);
        requests_.erase(found);
        return result;
    }

    // Runs the prompts together to the end; results in the order of the prompts.
    std::vector<RequestResult> generate(const std::vector<std::vector<int>>& prompts, const SamplingParams& params,
                                        const std::vector<std::string>& stop = {}) {
        std::vector<int> ids;
        for (const auto& prompt : prompts) ids.push_back(add_request(prompt, params, stop));
        while (has_work()) step();
        std::vector<RequestResult> results;
        for (int id : ids) results.push_back(*take_result(id));
        return results;
    }

    const std::vector<StepStats>& steps() const { return steps_; }
    const EngineTotals& totals() const { return totals_; }
    double now() const { return clock_.seconds(); }

private:
    // One request's state inside the engine: its sequence (what the scheduler sees) and everything per request that
    // the model does not know about: its own sampler and seed, its text stream, its stop strings and its clock.
    struct Request {
        Sequence seq;
        SamplingParams params;
        std::vector<std::string> stop;
        std::optional<Sampler> sampler;     // empty for a request refused at add_request
        std::optional<TextStream> stream;   // empty without a tokenizer: ids only
        std::vector<float> draft_q;         // [seq.draft, V] the proposer's q for the guesses; empty: one-hot
        std::string text;    // all text streamed so far (may end in held-back text)
        size_t emitted = 0;  // bytes of `text` already sent in events
        RequestTimes times;
        double accounted_until = 0;  // the end of the last step in its breakdown (or its arrival)
        bool in_step = false;        // part of the step being run: account() adds the step to its breakdown
        RequestResult result;
        bool stop_hit = false;  // a stop string was found: the text ends before it
        bool done = false;
    };

    // Requests that end before the step runs: cancelled ones, and ones add_request refused.
    void finish_waiting(std::vector<Event>& events) {
        for (int id : std::exchange(cancelled_, {}))
            if (requests_.count(id) && !requests_[id]->done) finish(id, FinishReason::Cancelled, "", events);
        for (auto& [id, reason, message] : std::exchange(pending_finish_, {}))
            if (!requests_.at(id)->done) finish(id, reason, message, events);
    }

    // The plan's chunks as one Batch; only a chunk's last token asks for logits, and only if it completes the sequence.
    void fill_batch(const SchedulePlan& plan, double step_start) {
        batch_.clear();
        for (const ScheduledChunk& chunk : plan.chunks) {
            Request& r = request_of(chunk.sequence);
            if (r.times.first_scheduled < 0) r.times.first_scheduled = step_start;
            for (int i = 0; i < chunk.count; ++i) {
                int position = chunk.start + i;
                // A drafted decode wants a row of logits for the real token and for each guess: k + 1 rows.
                bool logits = chunk.sample && i >= chunk.count - 1 - chunk.sequence->draft;
                batch_.add(chunk.sequence->tokens[position], position, chunk.sequence->id, logits);
            }
        }
    }

    // After the forward pass: the chunks' tokens are computed (and their full blocks named for prefix caching); each
    // sequence that sampled gets its next token (or, after a draft, its verified run); every request in the step adds
    // the step to its time breakdown.
    void sample_and_emit(const SchedulePlan& plan, std::span<const float> logits, StepStats& stats, std::vector<Event>& events) {
        size_t row = 0;
        std::vector<bool> before_first_token;
        for (const ScheduledChunk& chunk : plan.chunks) {
            Sequence& s = *chunk.sequence;
            before_first_token.push_back(request_of(&s).times.first_token < 0);
            request_of(&s).in_step = true;
            s.computed += chunk.count - s.draft;  // the guesses count as computed only once verified
            cache_.commit(s.id, std::span<const int>(s.tokens).first(s.tokens.size() - s.draft), s.computed);
            if (!chunk.sample) continue;
            const size_t rows = 1 + static_cast<size_t>(s.draft);
            sample(request_of(&s), logits.subspan(row * logits_.size(), rows * logits_.size()), stats, events);
            row += rows;
        }
        for (size_t i = 0; i < plan.chunks.size(); ++i) account(request_of(plan.chunks[i].sequence), stats, before_first_token[i]);
    }

    // The one place step statistics are collected: the step's own record (kept for traces) and the engine's totals.
    void record(const SchedulePlan& plan, StepStats& stats) {
        stats.prefill_tokens = plan.prefill_tokens;
        stats.decode_tokens = plan.decode_tokens;
        stats.sequences = static_cast<int>(plan.chunks.size());
        stats.preemptions = plan.preemptions;
        stats.prefix_hit_tokens = plan.prefix_hit_tokens;
        stats.draft_tokens = plan.draft_tokens;
        stats.blocks_used = cache_.used_block_count();
        stats.blocks_free = cache_.free_block_count();
        stats.blocks_cached = cache_.cached_block_count();
        if (!plan.chunks.empty()) {
            ++totals_.steps;
            // A long-running server keeps only the latest steps: once twice step_history have gathered, the older
            // half goes, one move per step_history steps rather than one per step.
            steps_.push_back(stats);
            const size_t keep = config_.step_history;
            if (keep > 0 && steps_.size() >= 2 * keep) steps_.erase(steps_.begin(), steps_.end() - static_cast<std::ptrdiff_t>(keep));
        }
        totals_.prefill_tokens += plan.prefill_tokens;
        totals_.decode_tokens += plan.decode_tokens;
        totals_.preemptions += plan.preemptions;
        totals_.prefix_hit_tokens += plan.prefix_hit_tokens;
        totals_.draft_tokens += stats.draft_tokens;
        totals_.accepted_tokens += stats.accepted_tokens;
    }

    static int pool_blocks(const ModelConfig& c, const EngineConfig& config) {
        if (config.block_size <= 0) fail("engine: block_size must be positive, found ", config.block_size);
        if (config.num_blocks > 0) return config.num_blocks;
        size_t bytes = config.kv_memory_bytes;
        if (bytes == 0)
            bytes = std::min<size_t>(size_t{1} << 30, KVCache::bytes_per_token(c, config.kv_dtype) *
                                                          static_cast<size_t>(c.context_length) *
                                                          static_cast<size_t>(std::max(config.scheduler.max_seqs, 1)));
        return KVCache::blocks_for_memory(c, bytes, config.block_size, config.kv_dtype);
    }

    Request& request_of(const Sequence* s) { return *requests_.at(s->id); }

    // Why the request can never run, or "" when it can.
    std::string check(const Request& r) const {
        const int prompt = r.seq.prompt_length, context = model_.config.context_length;
        try {
            r.params.validate();
        } catch (const Error& e) {
            return e.what();
        }
        if (prompt == 0) return "the prompt is empty: nothing to condition on (add BOS or some text)";
        for (int id : r.seq.tokens)
            if (id < 0 || id >= model_.config.vocab_size)
                return concat("prompt token id ", id, " is outside the vocabulary (", model_.config.vocab_size, " tokens)");
        // In 64 bits: max_tokens may be anything up to INT_MAX, and the sum must not wrap past the check.
        const int64_t needed = int64_t{prompt} + r.params.max_tokens;
        if (needed > context)
            return concat("the prompt (", prompt, " tokens) plus max_tokens (", r.params.max_tokens,
                                  ") exceed the model's context of ", context, " tokens");
        const int64_t blocks = (needed + cache_.block_size() - 1) / cache_.block_size();
        if (blocks > cache_.num_blocks())
            return concat("the prompt (", prompt, " tokens) plus max_tokens (", r.params.max_tokens, ") need ", blocks,
                                  " KV blocks of ", cache_.block_size(), " tokens, but the whole pool holds ", cache_.num_blocks());
        if (!r.stop.empty() && !tokenizer_) return "stop strings need a tokenizer, and this engine has none";
        for (const std::string& s : r.stop)
            if (s.empty()) return "a stop string is empty";
        return "";
    }

    // Adds a step the request took part in to its breakdown; the time since its last step is waiting.
    static void account(Request& r, const StepStats& step, bool prefill) {
        RequestBreakdown& b = r.times.breakdown;
        const double end = step.start + step.schedule + step.forward + step.sample + step.detokenize;
        b.queue += std::max(0.0, step.start - r.accounted_until);
        b.schedule += step.schedule;
        (prefill ? b.prefill : b.decode) += step.forward;
        b.sample += step.sample;
        b.detokenize += step.detokenize;
        r.accounted_until = end;
        r.in_step = false;
        if (r.done) {  // finished in this step: its result is complete when the step returns
            r.times.finished = end;
            r.result.times = r.times;
        }
    }

    void finish_later(int id, FinishReason reason, std::string message) {
        pending_finish_.push_back({id, reason, std::move(message)});
    }

    // The request's next ids from its rows of logits [1 + draft, V]: one row for a plain decode; after a draft of d
    // guesses, row i follows guess i, and the guesses are verified in order until one is replaced (or row d adds one
    // more). The rejected guesses leave the sequence and their blocks go back to the pool.
    void sample(Request& r, std::span<const float> rows, StepStats& stats, std::vector<Event>& events) {
        Sequence& s = r.seq;
        const size_t V = logits_.size();
        const int d = s.draft;
        drafted_.assign(s.tokens.end() - d, s.tokens.end());
        s.drop_draft();  // tokens == the verified ids again; each kept guess is appended back below
        if (d > 0) {
            ++r.result.draft_steps;
            r.result.draft_tokens += d;
        }
        Event event;
        event.request_id = s.id;
        for (int i = 0; i <= d; ++i) {
            std::span<const float> row = rows.subspan(static_cast<size_t>(i) * V, V);
            Stopwatch clock;
            logits_.assign(row.begin(), row.end());
            int next;
            try {
                if (i == d || r.params.temperature == 0) {
                    next = r.sampler->sample(logits_);  // greedy keeps a guess exactly when it is the argmax
                } else {
                    std::span<const float> q;
                    if (!r.draft_q.empty()) q = std::span<const float>(r.draft_q).subspan(static_cast<size_t>(i) * V, V);
                    next = verify_draft_token(*r.sampler, logits_, drafted_[i], q, scratch_);
                }
            } catch (const Error& e) {  // e.g. a grammar past its state limit: this request fails, the batch goes on
                stats.sample += clock.seconds();
                finish(s.id, FinishReason::Error, e.what(), events, &event);
                return;
            }
            stats.sample += clock.seconds();
            const bool kept = i < d && next == drafted_[i];
            if (kept) {
                ++r.result.accepted_tokens;
                ++stats.accepted_tokens;
            }
            bool going = false;
            try {
                going = emit(r, next, row, event, stats, events);
            } catch (const Error& e) {  // the grammar's step past its state limit, as above
                finish(s.id, FinishReason::Error, e.what(), events, &event);
                return;
            }
            if (!going) return;  // finished: the event went out with it
            if (!kept) break;
            ++s.computed;  // a kept guess's K/V were computed from this very id in this step
        }
        if (d > 0) {
            cache_.truncate(s.id, static_cast<int>(s.tokens.size()));  // blocks past the next position held rejects
            cache_.commit(s.id, s.tokens, s.computed);
        }
        events.push_back(std::move(event));
    }

    // Appends one sampled id to the request: the end (an end id, a stop string, max_tokens, the context) or its text.
    // Returns false when the request finished (the event, with this step's earlier ids, went out with finish()).
    bool emit(Request& r, int next, std::span<const float> row, Event& event, StepStats& stats, std::vector<Event>& events) {
        const double t = now();
        if (!r.params.ignore_eos && std::find(stop_ids_.begin(), stop_ids_.end(), next) != stop_ids_.end()) {
            finish(r.seq.id, FinishReason::Stop, "", events, &event);
            return false;
        }
        r.sampler->accept(next);
        r.seq.tokens.push_back(next);
        r.result.generated_ids.push_back(next);
        if (r.params.logprobs >= 0) r.result.logprobs.push_back(token_logprob(row, next, r.params.logprobs));
        r.times.token_times.push_back(t);
        if (r.times.first_token < 0) r.times.first_token = t;
        event.token_ids.push_back(next);
        if (r.params.logprobs >= 0) event.logprobs.push_back(r.result.logprobs.back());
        bool stopped = false;
        if (r.stream) {
            Stopwatch clock;
            r.text += r.stream->push(next);
            stopped = emit_text(r, event, false);
            stats.detokenize += clock.seconds();
        }
        const int generated = static_cast<int>(r.result.generated_ids.size());
        if (stopped || r.sampler->grammar_complete()) finish(r.seq.id, FinishReason::Stop, "", events, &event);
        else if (generated >= r.params.max_tokens || static_cast<int>(r.seq.tokens.size()) >= model_.config.context_length)
            finish(r.seq.id, FinishReason::Length, "", events, &event);
        else return true;
        return false;
    }

    // Speculative decoding's first half: each running sequence about to decode asks the proposer for up to k guesses,
    // which join its tokens (Sequence::draft of them) for the scheduler to place and the forward pass to verify.
    // Never more than the request may still produce, less the target's own token, nor past the context.
    void propose(StepStats& stats) {
        if (!proposer_) return;
        Stopwatch clock;
        draft_requests_.clear();
        for (Sequence* s : scheduler_.running()) {
            if (s->remaining() != 1) continue;
            Request& r = request_of(s);
            const int left = r.params.max_tokens - static_cast<int>(r.result.generated_ids.size()) - 1;
            const int room = model_.config.context_length - static_cast<int>(s->tokens.size());
            const int k = std::min({config_.spec.k, left, room});
            if (k > 0) draft_requests_.push_back({s->id, s->tokens, k, &r.params, r.sampler->seed(), {}, {}});
        }
        if (!draft_requests_.empty()) proposer_->propose(draft_requests_);
        for (DraftRequest& d : draft_requests_) {
            Request& r = *requests_.at(d.sequence);
            const size_t count = std::min(d.draft.size(), static_cast<size_t>(d.max_tokens));
            for (size_t i = 0; i < count; ++i)
                if (d.draft[i] < 0 || d.draft[i] >= model_.config.vocab_size)
                    fail("speculative decoding: the proposer drafted id ", d.draft[i], ", outside the vocabulary (",
                         model_.config.vocab_size, " tokens)");
            r.seq.tokens.insert(r.seq.tokens.end(), d.draft.begin(), d.draft.begin() + static_cast<std::ptrdiff_t>(count));
            r.seq.draft = static_cast<int>(count);
            r.draft_q = std::move(d.q);
            if (!r.draft_q.empty() && r.draft_q.size() < count * logits_.size())
                fail("speculative decoding: the proposer gave q for ", r.draft_q.size() / logits_.size(), " of its ", count, " ids");
        }
        stats.draft = clock.seconds();
    }

    // The proposer the configuration asks for (nullptr: none), after checking the configuration.
    std::shared_ptr<Proposer> make_proposer(const SpecConfig& spec, ThreadPool& pool) const {
        if (!spec.enabled()) return nullptr;
        if (spec.k < 1 || spec.k > 64) fail("speculative decoding: k (ids drafted per step) must be in 1..64, found ", spec.k);
        if (spec.proposer) return spec.proposer;
        if (spec.method == SpecMethod::Ngram) return std::make_shared<NgramProposer>(spec.ngram);
        if (!spec.draft_model) fail("speculative decoding with a draft model needs one (--draft-model PATH)");
        const Model& draft = *spec.draft_model;
        if (draft.config.vocab_size != model_.config.vocab_size)
            fail("speculative decoding: the draft model ", draft.source, " has a vocabulary of ", draft.config.vocab_size,
                 " tokens, the target ", model_.source, " one of ", model_.config.vocab_size, ": they must share it");
        return std::make_shared<DraftModelProposer>(draft, pool, cache_.num_blocks(), cache_.block_size());
    }

    // Moves newly streamed text into the event. A stop string found ends the text before it (returns true); a tail
    // that could still grow into one is held back unless this is the end.
    bool emit_text(Request& r, Event& event, bool at_end) {
        size_t longest = 0;
        for (const std::string& s : r.stop) longest = std::max(longest, s.size());
        size_t from = r.emitted > longest ? r.emitted - longest : 0;  // a match may straddle emitted text
        size_t cut = std::string::npos;
        for (const std::string& s : r.stop) cut = std::min(cut, r.text.find(s, from));
        if (cut != std::string::npos) {
            r.text.resize(cut);
            event.text += r.text.substr(std::min(r.emitted, cut));
            r.emitted = r.text.size();
            r.stop_hit = true;
            return true;
        }
        size_t keep = r.text.size();
        if (!at_end)  // hold back the longest tail of the text that is a proper prefix of some stop string
            for (const std::string& s : r.stop)
                for (size_t n = std::min(s.size() - 1, r.text.size()); n > 0; --n)
                    if (r.text.compare(r.text.size() - n, n, s, 0, n) == 0) {
                        keep = std::min(keep, r.text.size() - n);
                        break;
                    }
        if (keep > r.emitted) {
            event.text += r.text.substr(r.emitted, keep - r.emitted);
            r.emitted = keep;
        }
        return false;
    }

    void finish(int id, FinishReason reason, const std::string& message, std::vector<Event>& events, Event* last = nullptr) {
        Request& r = *requests_.at(id);
        Event event = last ? std::move(*last) : Event{};
        event.request_id = id;
        if (reason == FinishReason::Cancelled || reason == FinishReason::Error) {
            r.text.resize(r.emitted);  // what was never sent is not part of the result
        } else if (r.stream && !r.stop_hit) {  // the end: flush what the stream and the hold-back kept
            r.text += r.stream->finish();
            emit_text(r, event, true);
            if (r.stop_hit) reason = FinishReason::Stop;
        }
        event.finished = true;
        event.finish_reason = reason;
        event.error = message;
        r.done = true;
        r.times.finished = now();
        if (!r.in_step) {  // finished while waiting (cancelled, refused): all of it since its last step was waiting
            r.times.breakdown.queue += std::max(0.0, r.times.finished - r.accounted_until);
            r.accounted_until = r.times.finished;
        }
        scheduler_.remove(&r.seq);
        cache_.release(id);
        if (proposer_) proposer_->forget(id);
        r.result.id = id;
        r.result.prompt_ids.assign(r.seq.tokens.begin(), r.seq.tokens.begin() + r.seq.prompt_length);
        r.result.text = r.text;
        r.result.finish_reason = reason;
        r.result.error = message;
        r.result.seed = r.sampler ? r.sampler->seed() : 0;
        r.result.cached_tokens = r.seq.cached_tokens;
        r.result.preemptions = r.seq.preemptions;
        r.result.times = r.times;
        r.sampler.reset();
        r.stream.reset();
        events.push_back(std::move(event));
    }

    const Model& model_;
    EngineConfig config_;
    DeviceForwardPass forward_;
    Scheduler scheduler_;
    KVCache cache_;
    std::optional<Tokenizer> tokenizer_;
    std::vector<int> stop_ids_;  // the model's end ids and the tokenizer's
    std::unordered_map<int, std::unique_ptr<Request>> requests_;  // by id; pointers stay put while the scheduler holds them
    std::vector<int> cancelled_;  // asked for between steps, carried out at the next
    std::vector<std::tuple<int, FinishReason, std::string>> pending_finish_;
    Batch batch_;
    std::vector<float> logits_;  // [V] the row being sampled (the sampler edits it)
    std::shared_ptr<Proposer> proposer_;       // speculative decoding's, or none
    std::vector<DraftRequest> draft_requests_;  // this step's requests to the proposer
    std::vector<int> drafted_;                  // [draft] the guesses being verified
    std::vector<float> scratch_;                // [V] p, then the residual, during verification
    std::vector<StepStats> steps_;  // the latest steps that ran (step_history): the Chrome trace and chapter 06 read them
    EngineTotals totals_;
    Stopwatch clock_;               // every time in RequestTimes and StepStats counts from here
    int next_id_ = 0;
};

// The thread-safe front door: a thread that runs step() while there is work, and a submit/cancel that any thread may
// call. One mutex guards the engine, so a submit waits at most one step; each request's events go to its callback on
// the loop's thread, outside the lock (a callback may submit or cancel). Simple on purpose: a submit may wait for the
// step in progress (the loop lets waiting callers in before its next one); a server that must never wait would put a
// queue between the two sides. try_submit() and inspect() are the serving layer's: admission and routing (chapter 08).
class EngineLoop {
public:
    using Callback = std::function<void(const Event&)>;

    explicit EngineLoop(Engine& engine) : engine_(engine), thread_([this] { run(); }) {}
    EngineLoop(const EngineLoop&) = delete;
    EngineLoop& operator=(const EngineLoop&) = delete;
    ~EngineLoop() {
        {
            std::lock_guard lock(mutex_);
            stopping_ = true;
        }
        wake_.notify_all();
        thread_.join();
    }

    // Queues a request; `on_event` receives its events, the last with finished set. The result stays with the engine
    // until someone calls result(id).
    int submit(std::vector<int> prompt_ids, const SamplingParams& params, std::vector<std::string> stop, Callback on_event) {
        auto lock = caller_lock();
        int id = engine_.add_request(std::move(prompt_ids), params, std::move(stop));
        callbacks_[id] = std::move(on_event);
        wake_.notify_all();
        return id;
    }
    void cancel(int id) {
        auto lock = caller_lock();
        engine_.cancel(id);
        wake_.notify_all();
    }
    // submit(), but only if `admit` (asked under the lock, so no other submit slips in between) accepts the engine's
    // state: a server's admission control. nullopt: refused, nothing queued.
    std::optional<int> try_submit(std::vector<int> prompt_ids, const SamplingParams& params, std::vector<std::string> stop,
                                  Callback on_event, const std::function<bool(const Engine&)>& admit) {
        auto lock = caller_lock();
        if (!admit(engine_)) return std::nullopt;
        int id = engine_.add_request(std::move(prompt_ids), params, std::move(stop));
        callbacks_[id] = std::move(on_event);
        wake_.notify_all();
        return id;
    }
    std::optional<RequestResult> result(int id) {
        auto lock = caller_lock();
        return engine_.take_result(id);
    }
    // Runs `look` on the engine between steps, for routing and metrics (queue lengths, cache contents, totals).
    template <class Look>
    auto inspect(Look&& look) {
        auto lock = caller_lock();
        return look(std::as_const(engine_));
    }
    // Blocks until every submitted request has finished.
    void wait_idle() {
        auto lock = caller_lock();
        idle_.wait(lock, [&] { return !engine_.has_work() && delivering_ == 0; });
    }

private:
    // The lock for a caller of submit/cancel/result/inspect. std::mutex is not fair: the loop, which takes it again
    // right after each step, could keep an HTTP thread out for many steps. Callers announce themselves, and the loop
    // lets them in before its next step.
    std::unique_lock<std::mutex> caller_lock() {
        ++callers_;
        std::unique_lock lock(mutex_);
        --callers_;
        return lock;
    }

    void run() {
        std::unique_lock lock(mutex_);
        while (true) {
            wake_.wait(lock, [&] { return stopping_ || engine_.has_work(); });
            if (stopping_) return;
            std::vector<Event> events = engine_.step();
            std::vector<std::pair<Callback, Event>> deliveries;
            for (Event& event : events) {
                auto found = callbacks_.find(event.request_id);
                if (found == callbacks_.end()) continue;
                deliveries.emplace_back(found->second, std::move(event));
                if (deliveries.back().second.finished) callbacks_.erase(found);
            }
            ++delivering_;
            lock.unlock();
            for (auto& [callback, event] : deliveries)
                if (callback) callback(event);
            while (callers_ > 0) std::this_thread::yield();  // callers first: each waits at most one step
            lock.lock();
            --delivering_;
            if (!engine_.has_work()) idle_.notify_all();
        }
    }

    Engine& engine_;
    std::mutex mutex_;
    std::condition_variable wake_, idle_;
    std::unordered_map<int, Callback> callbacks_;
    int delivering_ = 0;
    std::atomic<int> callers_{0};  // threads waiting for the lock in caller_lock()
    bool stopping_ = false;
    std::thread thread_;  // last: it starts once everything above exists
};

// Chrome's trace-event format (chrome://tracing, ui.perfetto.dev): one track for the engine's steps (each an "X"
// event with its token counts, and its speculative ones when it verified drafts), one per request (queued, prefill until the first token, decode until it finished,
// and an instant mark at each sampled token).
inline void write_chrome_trace(std::ostream& out, std::span<const StepStats> steps, std::span<const RequestResult> requests) {
    auto us = [](double seconds) { return static_cast<long long>(seconds * 1e6); };
    out << "{\"traceEvents\":[\n";
    out << R"({"name":"thread_name","ph":"M","pid":1,"tid":0,"args":{"name":"engine steps"}})";
    for (size_t i = 0; i < steps.size(); ++i) {
        const StepStats& s = steps[i];
        double length = s.schedule + s.forward + s.sample + s.detokenize;
        out << ",\n{\"name\":\"step " << i << "\",\"ph\":\"X\",\"pid\":1,\"tid\":0,\"ts\":" << us(s.start)
            << ",\"dur\":" << std::max(1LL, us(length)) << ",\"args\":{\"prefill_tokens\":" << s.prefill_tokens
            << ",\"decode_tokens\":" << s.decode_tokens << ",\"sequences\":" << s.sequences
            << ",\"preemptions\":" << s.preemptions << ",\"prefix_hit_tokens\":" << s.prefix_hit_tokens
            << ",\"blocks_used\":" << s.blocks_used << ",\"blocks_free\":" << s.blocks_free
            << ",\"blocks_cached\":" << s.blocks_cached << ",\"forward_ms\":" << s.forward * 1e3;
        if (s.draft_tokens > 0)  // speculative decoding: guesses verified, kept, and the proposer's time
            out << ",\"draft_tokens\":" << s.draft_tokens << ",\"accepted_tokens\":" << s.accepted_tokens
                << ",\"draft_ms\":" << s.draft * 1e3;
        out << "}}";
    }
    for (const RequestResult& r : requests) {
        const RequestTimes& t = r.times;
        const int tid = r.id + 1;
        out << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":" << tid << ",\"args\":{\"name\":\"request " << r.id << "\"}}";
        auto span = [&](const char* name, double from, double to) {
            if (from < 0 || to < from) return;
            out << ",\n{\"name\":\"" << name << "\",\"ph\":\"X\",\"pid\":1,\"tid\":" << tid << ",\"ts\":" << us(from)
                << ",\"dur\":" << std::max(1LL, us(to) - us(from)) << ",\"args\":{\"prompt_tokens\":" << r.prompt_ids.size()
                << ",\"generated_tokens\":" << r.generated_ids.size() << ",\"cached_tokens\":" << r.cached_tokens
                << ",\"draft_tokens\":" << r.draft_tokens << ",\"accepted_tokens\":" << r.accepted_tokens
                << ",\"finish_reason\":\"" << finish_reason_name(r.finish_reason) << "\"}}";
        };
        const double scheduled = t.first_scheduled >= 0 ? t.first_scheduled : t.finished;
        span("queued", t.arrival, scheduled);
        span("prefill", t.first_scheduled, t.first_token >= 0 ? t.first_token : t.finished);
        span("decode", t.first_token, t.finished);
        for (size_t i = 0; i < t.token_times.size(); ++i)
            out << ",\n{\"name\":\"token\",\"ph\":\"i\",\"s\":\"t\",\"pid\":1,\"tid\":" << tid << ",\"ts\":"
                << us(t.token_times[i]) << ",\"args\":{\"index\":" << i << ",\"id\":" << r.generated_ids[i] << "}}";
    }
    out << "\n]}\n";
}

// ==== 07 HARDWARE ====================================================================================================
// Where the forward pass runs: the CPU code of section 04 (its SIMD kernels in appendix F), or the CUDA kernels of
// infer_cuda.cu (a build with nvcc defines INFER_CUDA and links them). Both take the same Batch and the same KVCache
// (it keeps the block tables; on the GPU the keys and values live in device memory, [L, num_blocks, B, Hkv, Dh], the
// same blocks under the same ids) and give the same logits [rows, V] in host memory, so the sampler, scheduler, engine
// and server do not know which ran. Decode streams every weight once per step (memory-bound: it should run near the memory bandwidth);
// prefill is matrix-matrix work (compute-bound: near the FMA or tensor-core rate). Chapter 07 puts both on a roofline.

#ifdef INFER_CUDA
// Implemented in infer_cuda.cu; declared here so the header stays standard-library-only.
namespace cuda {

bool device_available(std::string* why = nullptr);  // false (and why) when no CUDA device can be used
std::string device_description(int device = 0);     // "NVIDIA H200, 132 SMs, 139 GiB, sm_90"
double measure_copy_bandwidth(size_t bytes = size_t{1} << 30, int repeats = 20);  // bytes/s, read + written
double measure_bf16_matmul_rate(int n = 8192, int repeats = 20);                  // flop/s of cuBLAS bf16, f32 sums

// The forward pass on the GPU: ForwardPass's interface, weights uploaded once by make_forward_pass. An interface
// (device buffers, cuBLAS and graphs stay inside infer_cuda.cu) so that a program may also load the CUDA code as a
// module on demand, as the infer program does, instead of linking it.
class ForwardPass {
public:
    virtual ~ForwardPass() = default;
    virtual const Model& model() const = 0;
    // Logits [rows, V] (host memory, valid until the next call) for the tokens whose wants_logits is set.
    virtual std::span<const float> forward(const Batch& batch, KVCache& cache) = 0;
};
std::unique_ptr<ForwardPass> make_forward_pass(const Model& model, CudaOptions options = {});

// What a program and the CUDA module it loads on demand must agree on: both compile this header, and another version
// of the types they pass would be read wrongly. A guard against a stale file, checked when the module is opened.
inline unsigned long long module_layout() {
    unsigned long long stamp = INFER_VERSION_MAJOR * 1000000ull + INFER_VERSION_MINOR * 1000ull + INFER_VERSION_PATCH;
    for (size_t size : {sizeof(Model), sizeof(ModelConfig), sizeof(Tensor), sizeof(Batch), sizeof(KVCache), sizeof(CudaOptions)})
        stamp = stamp * 1099511628211ull ^ size;
    return stamp;
}

// Each kernel alone on host data, so the tests can hold it against its CPU twin.
namespace kernels {
enum class MatmulKernel { Vector, Tiled, Cublas };
std::vector<float> embedding(const Tensor& table, const std::vector<int>& ids);                        // [T, D]
// x [T, D] += add (if not empty), returns rms_norm(x) · gain [T, D]
std::vector<float> add_rms_norm(std::vector<float>& x, const std::vector<float>& add, const Tensor& gain, int D, double eps);
// x [T, heads, Dh]: per-head norm (if `norm` is not empty), then RoPE with cos/sin [T, Dh/2]
std::vector<float> rope(const std::vector<float>& x, int heads, int Dh, const Tensor& norm, double eps,
                        const std::vector<float>& cos, const std::vector<float>& sin, RopeStyle style);
// k, v [T, width] into pools of `pool_slots` slots; returns the key pool then the value pool, [2, pool_slots, width]
std::vector<float> write_kv(const std::vector<float>& k, const std::vector<float>& v, const std::vector<int>& slots,
                            int width, int pool_slots);
std::vector<float> matmul(const Tensor& w, const std::vector<float>& x, int T, const Tensor* bias, MatmulKernel kernel);
std::vector<float> dequantize(const Tensor& w);  // a Q8_0 or Q4_K matrix decoded on the device: [rows, cols]
// q [T, H, Dh] over the keys and values `cache` holds (host) for `layer`: [T, H, Dh]
std::vector<float> attention(const std::vector<float>& q, const KVCache& cache, int layer, const Batch& batch,
                             const ModelConfig& config, bool prefill_kernel);
std::vector<float> swiglu(const std::vector<float>& gate, const std::vector<float>& up);
}  // namespace kernels

}  // namespace cuda
#endif

inline bool cuda_compiled() {
#ifdef INFER_CUDA
    return true;
#else
    return false;
#endif
}

// Whether --device cuda can run here; `why` says what is missing when not.
inline bool cuda_available(std::string* why = nullptr) {
#ifdef INFER_CUDA
    return cuda::device_available(why);
#else
    if (why) *why = "this build has no CUDA kernels (build with nvcc present: meson setup -Dcuda=enabled)";
    return false;
#endif
}

inline DeviceForwardPass::DeviceForwardPass(const Model& model, ThreadPool& pool, Device device, CudaOptions options)
    : cpu_(model, pool), device_(device) {
    if (device == Device::Cuda) {
#ifdef INFER_CUDA
        cuda_ = cuda::make_forward_pass(model, options);
#else
        (void)options;
        fail("--device cuda: this build has no CUDA kernels (build with nvcc present: meson setup -Dcuda=enabled)");
#endif
    }
}

inline DeviceForwardPass::~DeviceForwardPass() = default;

inline std::span<const float> DeviceForwardPass::forward(const Batch& batch, KVCache& cache) {
#ifdef INFER_CUDA
    if (cuda_) return cuda_->forward(batch, cache);
#endif
    return cpu_.forward(batch, cache);
}

// ==== A JSON AND GGUF VALUES =========================================================================================
// The parsers behind Json::parse and read_gguf's metadata: strict, bounds-checked, and with messages that name the
// file and the byte offset, because these bytes come from files a user downloaded.

namespace detail {

inline void append_utf8(std::string& out, uint32_t code_point) {
    if (code_point < 0x80) {
        out += static_cast<char>(code_point);
    } else if (code_point < 0x800) {
        out += static_cast<char>(0xC0 | (code_point >> 6));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    } else if (code_point < 0x10000) {
        out += static_cast<char>(0xE0 | (code_point >> 12));
        out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (code_point >> 18));
        out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    }
}

class JsonParser {
public:
    JsonParser(std::string_view text, std::string_view origin) : text_(text), origin_(origin) {}

    Json parse_document() {
        Json value = parse_value(0);
        skip_space();
        if (pos_ != text_.size()) error("unexpected text after the JSON value");
        return value;
    }

private:
    static constexpr int max_depth = 256;  // a hostile file cannot blow the stack

    [[noreturn]] void error(std::string_view what) const { fail(origin_, ": invalid JSON at byte ", pos_, ": ", what); }

    void skip_space() {
        while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\r' || text_[pos_] == '\t'))
            ++pos_;
    }
    bool consume(char expected) {
        skip_space();
        if (pos_ < text_.size() && text_[pos_] == expected) {
            ++pos_;
            return true;
        }
        return false;
    }
    void expect(char expected) {
        if (!consume(expected)) error(concat("expected '", expected, "'"));
    }
    bool consume_word(std::string_view word) {
        if (text_.substr(pos_, word.size()) != word) return false;
        pos_ += word.size();
        return true;
    }

    Json parse_value(int depth) {
        if (depth > max_depth) error("nesting too deep");
        skip_space();
        if (pos_ >= text_.size()) error("unexpected end of input");
        char c = text_[pos_];
        if (c == '{') return parse_object(depth);
        if (c == '[') return parse_array(depth);
        if (c == '"') return Json(parse_string());
        if (consume_word("true")) return Json(true);
        if (consume_word("false")) return Json(false);
        if (consume_word("null")) return Json();
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
        // NaN and Infinity are not JSON, but Python's json module writes them: accept them as numbers.
        if (consume_word("NaN")) return Json(std::numeric_limits<double>::quiet_NaN());
        if (consume_word("Infinity")) return Json(std::numeric_limits<double>::infinity());
        error(concat("unexpected character '", c, "'"));
    }

    Json parse_object(int depth) {
        ++pos_;
        Json::Object members;
        if (consume('}')) return Json(std::move(members));
        do {
            skip_space();
            if (pos_ >= text_.size() || text_[pos_] != '"') error("expected a string key");
            std::string key = parse_string();
            expect(':');
            members.emplace_back(std::move(key), parse_value(depth + 1));
        } while (consume(','));
        expect('}');
        return Json(std::move(members));
    }

    Json parse_array(int depth) {
        ++pos_;
        Json::Array items;
        if (consume(']')) return Json(std::move(items));
        do items.push_back(parse_value(depth + 1));
        while (consume(','));
        expect(']');
        return Json(std::move(items));
    }

    Json parse_number() {
        size_t start = pos_;
        if (text_[pos_] == '-') {
            ++pos_;
            if (consume_word("Infinity")) return Json(-std::numeric_limits<double>::infinity());
        }
        while (pos_ < text_.size() && std::strchr("0123456789.eE+-", text_[pos_])) ++pos_;
        std::string digits(text_.substr(start, pos_ - start));
        char* end = nullptr;
        double value = std::strtod(digits.c_str(), &end);
        if (end != digits.c_str() + digits.size() || digits == "-") {
            pos_ = start;
            error(concat("malformed number \"", digits, "\""));
        }
        return Json(value);
    }

    uint32_t parse_hex4() {
        if (pos_ + 4 > text_.size()) error("truncated \\u escape");
        uint32_t value = 0;
        for (int i = 0; i < 4; ++i) {
            char c = text_[pos_++];
            value <<= 4;
            if (c >= '0' && c <= '9') value |= c - '0';
            else if (c >= 'a' && c <= 'f') value |= c - 'a' + 10;
            else if (c >= 'A' && c <= 'F') value |= c - 'A' + 10;
            else error("bad hex digit in \\u escape");
        }
        return value;
    }

    std::string parse_string() {
        ++pos_;  // opening quote
        std::string out;
        while (true) {
            if (pos_ >= text_.size()) error("unterminated string");
            char c = text_[pos_++];
            if (c == '"') return out;
            if (static_cast<unsigned char>(c) < 0x20) error("control character in string");
            if (c != '\\') {
                out += c;
                continue;
            }
            if (pos_ >= text_.size()) error("unterminated escape");
            char escaped = text_[pos_++];
            switch (escaped) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    uint32_t code = parse_hex4();
                    // A UTF-16 surrogate pair encodes one code point above U+FFFF.
                    if (code >= 0xD800 && code < 0xDC00 && text_.substr(pos_, 2) == "\\u") {
                        pos_ += 2;
                        uint32_t low = parse_hex4();
                        if (low < 0xDC00 || low > 0xDFFF) error("unpaired surrogate in \\u escape");
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                    }
                    append_utf8(out, code);
                    break;
                }
                default: error(concat("unknown escape \\", escaped));
            }
        }
    }

    std::string_view text_;
    std::string origin_;
    size_t pos_ = 0;
};

}  // namespace detail

inline void write_json_string(std::ostream& out, std::string_view text) {
    // JSON text is UTF-8: bytes that are not (a prompt's, a file's) become U+FFFD rather than an unreadable document.
    std::string repaired;
    if (detail::find_invalid_utf8(text) != std::string_view::npos) text = repaired = detail::utf8_lossy(text);
    out << '"';
    for (char c : text) {
        if (c == '"' || c == '\\') out << '\\' << c;
        else if (c == '\n') out << "\\n";
        else if (static_cast<unsigned char>(c) < 0x20) {
            char escape[8];
            std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(c));
            out << escape;
        } else out << c;
    }
    out << '"';
}

inline std::string Json::dump() const {
    std::ostringstream out;
    std::visit([&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::monostate>) out << "null";
        else if constexpr (std::is_same_v<T, bool>) out << (v ? "true" : "false");
        else if constexpr (std::is_same_v<T, double>) {
            char buffer[32];  // the shortest text that reads back as the same double; whole numbers without ".0"
            out << std::string_view(buffer, static_cast<size_t>(std::to_chars(buffer, buffer + sizeof buffer, v).ptr - buffer));
        } else if constexpr (std::is_same_v<T, std::string>) write_json_string(out, v);
        else if constexpr (std::is_same_v<T, Array>) {
            out << '[';
            for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i].dump();
            out << ']';
        } else {
            out << '{';
            for (size_t i = 0; i < v.size(); ++i) {
                if (i) out << ',';
                write_json_string(out, v[i].first);
                out << ':' << v[i].second.dump();
            }
            out << '}';
        }
    }, value_);
    return out.str();
}

inline Json Json::parse(std::string_view text, std::string_view origin) {
    return detail::JsonParser(text, origin).parse_document();
}

namespace detail {

enum GgufType : uint32_t { U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

inline int64_t gguf_read_integer(ByteReader& in, uint32_t type) {
    switch (type) {
        case U8: return in.read<uint8_t>();
        case I8: return in.read<int8_t>();
        case U16: return in.read<uint16_t>();
        case I16: return in.read<int16_t>();
        case U32: return in.read<uint32_t>();
        case I32: return in.read<int32_t>();
        case U64: return static_cast<int64_t>(in.read<uint64_t>());
        case I64: return in.read<int64_t>();
        case BOOL: return in.read<uint8_t>() != 0;
    }
    return 0;
}

inline bool gguf_is_integer(uint32_t type) {
    return type <= I32 || type == U64 || type == I64 || type == BOOL;
}

inline GgufValue gguf_read_value(ByteReader& in, uint32_t type, const std::string& path, const std::string& key) {
    GgufValue out;
    out.type = type;
    if (type == F32) out.value = static_cast<double>(in.read<float>());
    else if (type == F64) out.value = in.read<double>();
    else if (type == BOOL) out.value = in.read<uint8_t>() != 0;
    else if (type == STRING) out.value = in.read_string();
    else if (gguf_is_integer(type)) out.value = gguf_read_integer(in, type);
    else if (type == ARRAY) {
        uint32_t item_type = in.read<uint32_t>();
        out.item_type = item_type;
        uint64_t count = in.read<uint64_t>();
        in.need(count, "an array");  // each item takes at least a byte: a cheap bound before reserving
        if (item_type == STRING) {
            std::vector<std::string> items;
            items.reserve(count);
            for (uint64_t i = 0; i < count; ++i) items.push_back(in.read_string());
            out.value = std::move(items);
        } else if (item_type == F32 || item_type == F64) {
            std::vector<double> items;
            items.reserve(count);
            for (uint64_t i = 0; i < count; ++i) items.push_back(item_type == F32 ? in.read<float>() : in.read<double>());
            out.value = std::move(items);
        } else if (gguf_is_integer(item_type)) {
            std::vector<int64_t> items;
            items.reserve(count);
            for (uint64_t i = 0; i < count; ++i) items.push_back(gguf_read_integer(in, item_type));
            out.value = std::move(items);
        } else {
            fail(path, ": metadata ", key, ": unsupported array item type ", item_type);
        }
    } else {
        fail(path, ": metadata ", key, ": unknown value type ", type);
    }
    return out;
}

// GGUF's string: a 64-bit length, then the bytes (keys, tensor names and string values alike).
inline void gguf_append_string(std::string& out, const std::string& text) {
    const uint64_t length = text.size();
    out.append(reinterpret_cast<const char*>(&length), sizeof length);
    out += text;
}

// The inverse of gguf_read_value: the type tag, then the value in that type (infer quantize writes files back).
inline void gguf_append_value(std::string& out, const GgufValue& v) {
    auto put = [&out](auto value) { out.append(reinterpret_cast<const char*>(&value), sizeof value); };
    auto put_string = [&out](const std::string& text) { gguf_append_string(out, text); };
    auto put_item = [&](uint32_t type, const auto& item) {
        using Item = std::decay_t<decltype(item)>;
        if constexpr (std::is_same_v<Item, std::string>) {
            put_string(item);
        } else if constexpr (std::is_same_v<Item, double>) {
            if (type == F32) put(static_cast<float>(item));
            else put(item);
        } else {
            switch (type) {
                case U8: case BOOL: put(static_cast<uint8_t>(item)); break;
                case I8: put(static_cast<int8_t>(item)); break;
                case U16: put(static_cast<uint16_t>(item)); break;
                case I16: put(static_cast<int16_t>(item)); break;
                case U32: put(static_cast<uint32_t>(item)); break;
                case I32: put(static_cast<int32_t>(item)); break;
                case U64: put(static_cast<uint64_t>(item)); break;
                default: put(static_cast<int64_t>(item)); break;
            }
        }
    };
    put(v.type);
    std::visit([&](const auto& value) {
        using Value = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<Value, std::vector<int64_t>> || std::is_same_v<Value, std::vector<double>> ||
                      std::is_same_v<Value, std::vector<std::string>>) {
            put(v.item_type);
            put(uint64_t{value.size()});
            for (const auto& item : value) put_item(v.item_type, item);
        } else if constexpr (std::is_same_v<Value, bool>) {
            put(static_cast<uint8_t>(value));
        } else {
            put_item(v.type, value);
        }
    }, v.value);
}

inline const char* gguf_tensor_type_name(uint32_t type) {
    static const std::map<uint32_t, const char*> names = {
        {0, "F32"},   {1, "F16"},   {2, "Q4_0"},  {3, "Q4_1"},   {6, "Q5_0"},    {7, "Q5_1"},    {8, "Q8_0"},
        {9, "Q8_1"},  {10, "Q2_K"}, {11, "Q3_K"}, {12, "Q4_K"},  {13, "Q5_K"},   {14, "Q6_K"},   {15, "Q8_K"},
        {16, "IQ2_XXS"}, {17, "IQ2_XS"}, {18, "IQ3_XXS"}, {19, "IQ1_S"}, {20, "IQ4_NL"}, {21, "IQ3_S"}, {22, "IQ2_S"},
        {23, "IQ4_XS"}, {24, "I8"}, {25, "I16"}, {26, "I32"}, {27, "I64"}, {28, "F64"}, {29, "IQ1_M"}, {30, "BF16"},
        {34, "TQ1_0"}, {35, "TQ2_0"}};
    auto found = names.find(type);
    return found == names.end() ? nullptr : found->second;
}

}  // namespace detail

// ---- GGUF metadata lookups ------------------------------------------------------------------------------------------

inline const detail::GgufValue* GgufFile::find(const std::string& key) const {
    auto found = metadata.find(key);
    return found == metadata.end() ? nullptr : &found->second;
}

inline int64_t GgufFile::integer(const std::string& key) const {
    const detail::GgufValue* v = find(key);
    if (!v) fail(file->path(), ": missing GGUF metadata ", key);
    if (auto* i = std::get_if<int64_t>(&v->value)) return *i;
    if (auto* b = std::get_if<bool>(&v->value)) return *b;
    fail(file->path(), ": GGUF metadata ", key, " is not an integer");
}

inline int64_t GgufFile::integer_or(const std::string& key, int64_t fallback) const {
    return find(key) ? integer(key) : fallback;
}

inline double GgufFile::number_or(const std::string& key, double fallback) const {
    const detail::GgufValue* v = find(key);
    if (!v) return fallback;
    if (auto* d = std::get_if<double>(&v->value)) return *d;
    if (auto* i = std::get_if<int64_t>(&v->value)) return static_cast<double>(*i);
    fail(file->path(), ": GGUF metadata ", key, " is not a number");
}

inline std::string GgufFile::string_or(const std::string& key, std::string fallback) const {
    const detail::GgufValue* v = find(key);
    if (!v) return fallback;
    if (auto* s = std::get_if<std::string>(&v->value)) return *s;
    fail(file->path(), ": GGUF metadata ", key, " is not a string");
}

// ==== B NUMBERS, FILES AND THREADS ===================================================================================
// The f32 → bf16/f16 roundings and f16 → f32 (with subnormals, infinities and NaN), mapping a file, and the thread
// pool's insides: between sections a worker spins on an atomic counter for a short while (spin_budget) before it
// sleeps on it (a futex on Linux, tens of microseconds to wake on a VM). An idle pool costs nothing after the budget.

inline uint16_t f32_to_bf16(float value) {
    uint32_t bits = std::bit_cast<uint32_t>(value);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep NaN a NaN
    bits += 0x7FFF + ((bits >> 16) & 1);                                                       // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t half) {
    uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
    uint32_t exponent = (half >> 10) & 0x1F;
    uint32_t mantissa = half & 0x3FF;
    if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000 | (mantissa << 13));  // inf / NaN
    if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
    // Zero and the subnormals: mantissa · 2^-24, exact in f32 (a multiply, so the whole function stays small enough to
    // inline: the block decoders call it once per block).
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
}

inline uint16_t f32_to_f16(float value) {
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
    const uint32_t magnitude = bits & 0x7FFFFFFF;
    if (magnitude >= 0x47800000) return sign | (magnitude > 0x7F800000 ? 0x7E00 : 0x7C00);  // 2^16 on: ∞, or NaN
    if (magnitude < 0x38800000) {  // below 2^-14, f16's smallest normal: a multiple of 2^-24
        // Added to 0.5, whose last mantissa bit is worth 2^-24, the value is rounded (to nearest even) where f16
        // rounds it, and what the sum holds above 0.5 is the f16 bits: a count of 2^-24, up to 1024 (0x400, the bits
        // of 2^-14, for the values that round up to it).
        const float shifted = std::bit_cast<float>(magnitude) + 0.5f;
        return sign | static_cast<uint16_t>(std::bit_cast<uint32_t>(shifted) - 0x3F000000);
    }
    // Normal: the exponent rebiased (127 → 15) and the 13 dropped mantissa bits rounded to nearest even. A carry out of
    // the mantissa lands in the exponent, which is what rounding up to the next power of two means (to ∞ from 65520).
    // A few integer steps rather than frexp and nearbyint, which would cost an f16 cache's writes a few per cent of a
    // prefill.
    const uint32_t odd = (magnitude >> 13) & 1;
    return sign | static_cast<uint16_t>((magnitude - 0x38000000 + 0xFFF + odd) >> 13);
}

namespace detail {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// Calls ready() until it returns true or the budget runs out; returns its last answer. After a few microseconds of
// pure spinning it yields the core at each round, so that when the machine has more runnable threads than cores (tests
// in parallel, other programs) the thread we wait for gets to run instead of our spin.
template <class Ready>
bool spin_until(Ready ready, std::chrono::microseconds budget) {
    auto deadline = std::chrono::steady_clock::now() + budget;
    for (int round = 0;; ++round) {
        if (ready()) return true;
        if (round < 256) {
            cpu_relax();
            continue;
        }
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() > deadline) return ready();
    }
}
}  // namespace detail

inline ThreadPool::ThreadPool(int threads) {
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    size_ = threads;
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

inline ThreadPool::~ThreadPool() {
    stopping_ = true;
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& worker : workers_) worker.join();
}

// Publishes the job, bumps the generation the workers watch, runs share 0 here, then waits for the others: spinning
// for the spin budget, sleeping on the counter after that.
inline void ThreadPool::run_job(Job job, void* context, size_t count) {
    job_ = job;
    context_ = context;
    count_ = count;
    pending_.store(size_ - 1);
    generation_.fetch_add(1);
    generation_.notify_all();
    run_share(0);
    while (!detail::spin_until([&] { return pending_.load() == 0; }, spin_budget)) {
        int left = pending_.load();
        if (left != 0) pending_.wait(left);
    }
}

inline void ThreadPool::run_share(int thread) {
    size_t begin = count_ * thread / size_;
    size_t end = count_ * (thread + 1) / size_;
    if (begin < end) job_(context_, begin, end, thread);
}

inline void ThreadPool::worker_loop(int thread) {
    uint64_t seen = 0;
    while (true) {
        if (!detail::spin_until([&] { return generation_.load() != seen; }, spin_budget)) {
            generation_.wait(seen);
            continue;
        }
        seen = generation_.load();
        if (stopping_) return;
        run_share(thread);
        if (pending_.fetch_sub(1) == 1) pending_.notify_one();
    }
}

// ---- Files ----------------------------------------------------------------------------------------------------------

namespace detail {
// `bytes` of uninitialized memory, in 2 MB pages where Linux allows: `start` receives the first byte (2 MB aligned),
// the returned block owns them.
inline std::unique_ptr<std::byte[]> huge_page_buffer(size_t bytes, std::byte*& start) {
    constexpr size_t huge_page = size_t{2} << 20;
    auto block = std::make_unique_for_overwrite<std::byte[]>(bytes + huge_page);
    start = block.get() + (huge_page - reinterpret_cast<uintptr_t>(block.get()) % huge_page) % huge_page;
#ifdef MADV_HUGEPAGE
    madvise(start, (bytes + huge_page - 1) / huge_page * huge_page, MADV_HUGEPAGE);  // advice only: may be refused
#endif
    return block;
}
}  // namespace detail

inline MappedFile::MappedFile(const std::filesystem::path& path, FileAccess access) : path_(path.string()) {
#ifdef INFER_HAVE_MMAP
    if (access == FileAccess::Map) {
        int fd = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK);  // a FIFO must not block the open: fstat refuses it below
        if (fd < 0) fail(path_, ": cannot open: ", std::strerror(errno));
        struct stat info {};
        if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
            ::close(fd);
            fail(path_, ": not a regular file");
        }
        size_ = static_cast<size_t>(info.st_size);
        if (size_ > 0) {
            void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
            if (mapped == MAP_FAILED) {
                ::close(fd);
                fail(path_, ": mmap failed: ", std::strerror(errno));
            }
            data_ = static_cast<const std::byte*>(mapped);
        }
        ::close(fd);  // the mapping keeps the file alive
        return;
    }
#endif
    std::error_code error;
    if (!std::filesystem::is_regular_file(path, error)) fail(path_, ": not a regular file");
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(path_, ": cannot open");
    in.seekg(0, std::ios::end);
    size_ = static_cast<size_t>(in.tellg());
    in.seekg(0);
    // In 2 MB pages where Linux allows: a decode step reads every weight once, and 4 KB pages cost it a page walk
    // every 4 KB.
    std::byte* start = nullptr;
    copy_ = detail::huge_page_buffer(size_, start);
    in.read(reinterpret_cast<char*>(start), static_cast<std::streamsize>(size_));
    if (!in) fail(path_, ": read failed");
    data_ = start;
}

inline MappedFile::~MappedFile() {
#ifdef INFER_HAVE_MMAP
    if (data_ && size_ > 0 && !copy_) ::munmap(const_cast<std::byte*>(data_), size_);
#endif
}

// Closes a file written through an ofstream and checks that every byte reached it: an ofstream buffers, so a full
// disk shows only when the buffer is flushed, and the flush in a destructor cannot report it.
inline void close_written_file(std::ofstream& out, const std::string& name) {
    out.close();
    if (!out) fail(name, ": write failed (", std::strerror(errno), ")");
}

inline std::string read_text_file(const std::filesystem::path& path) {
    // Regular files only: a FIFO or a device would block the read, or never end.
    std::error_code error;
    if (!std::filesystem::is_regular_file(path, error)) fail(path.string(), ": not a regular file (or missing)");
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(path.string(), ": cannot open");
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}


namespace detail {
// ---- The sampler's random numbers -----------------------------------------------------------------------------------
// xoshiro256** (Blackman and Vigna): 256 bits of state, seeded through splitmix64 so that nearby seeds give unrelated
// streams.
inline void seed_xoshiro(std::array<uint64_t, 4>& state, uint64_t seed) {
    for (auto& word : state) {
        seed += 0x9E3779B97F4A7C15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        word = z ^ (z >> 31);
    }
}

inline uint64_t next_xoshiro(std::array<uint64_t, 4>& s) {
    auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}
}  // namespace detail

// ==== C UNICODE ======================================================================================================
// UTF-8 decoding and repair, the Unicode categories the split patterns ask for (\p{L}, \p{N}, \s), and NFC
// normalization (UAX #15) that Qwen's tokenizer applies. The tables are generated from Python's unicodedata by
// scripts/make_unicode_tables.py, so the header stays self-contained.

// ---- UTF-8 ----------------------------------------------------------------------------------------------------------

namespace detail {

// Length of the UTF-8 sequence that starts with `lead`, or 0 for a byte that cannot start one.
inline int utf8_sequence_length(unsigned char lead) {
    if (lead < 0x80) return 1;
    if ((lead & 0xE0) == 0xC0) return lead >= 0xC2 ? 2 : 0;
    if ((lead & 0xF0) == 0xE0) return 3;
    if ((lead & 0xF8) == 0xF0) return lead <= 0xF4 ? 4 : 0;
    return 0;
}

// Byte offset of the first invalid UTF-8 sequence in `text`, or npos when it is all valid.
inline size_t find_invalid_utf8(std::string_view text) {
    size_t i = 0;
    while (i < text.size()) {
        auto lead = static_cast<unsigned char>(text[i]);
        int length = utf8_sequence_length(lead);
        if (length == 0 || i + length > text.size()) return i;
        for (int k = 1; k < length; ++k)
            if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return i;
        // Reject overlong forms, surrogates and code points past U+10FFFF.
        auto second = static_cast<unsigned char>(length > 1 ? text[i + 1] : 0);
        if ((lead == 0xE0 && second < 0xA0) || (lead == 0xED && second >= 0xA0) || (lead == 0xF0 && second < 0x90) ||
            (lead == 0xF4 && second >= 0x90))
            return i;
        i += static_cast<size_t>(length);
    }
    return std::string_view::npos;
}

// The code point that starts at text[i] (valid UTF-8: the caller checked), and its length in bytes.
inline char32_t code_point_at(std::string_view text, size_t i, int* length = nullptr) {
    auto lead = static_cast<unsigned char>(text[i]);
    int n = std::max(1, utf8_sequence_length(lead));
    char32_t cp = n == 1 ? lead : n == 2 ? lead & 0x1F : n == 3 ? lead & 0x0F : lead & 0x07;
    for (int k = 1; k < n && i + k < text.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
    if (length) *length = n;
    return cp;
}

inline std::u32string to_code_points(std::string_view text) {
    std::u32string out;
    out.reserve(text.size());
    int n = 0;
    for (size_t i = 0; i < text.size(); i += static_cast<size_t>(n)) out += code_point_at(text, i, &n);
    return out;
}

inline constexpr std::string_view replacement_character = "\xEF\xBF\xBD";  // U+FFFD

// Bytes to text as Rust's String::from_utf8_lossy (what Hugging Face decoders use): each maximal invalid subpart, i.e.
// the longest run that starts like a valid sequence but breaks off, becomes one U+FFFD.
inline std::string utf8_lossy(std::string_view bytes) {
    std::string out;
    out.reserve(bytes.size());
    size_t i = 0;
    while (i < bytes.size()) {
        auto lead = static_cast<unsigned char>(bytes[i]);
        int n = utf8_sequence_length(lead);
        if (n == 1) {
            out += bytes[i++];
            continue;
        }
        if (n == 0) {
            out += replacement_character;
            ++i;
            continue;
        }
        unsigned char low = 0x80, high = 0xBF;  // the second byte's range excludes overlongs and surrogates
        if (lead == 0xE0) low = 0xA0;
        if (lead == 0xED) high = 0x9F;
        if (lead == 0xF0) low = 0x90;
        if (lead == 0xF4) high = 0x8F;
        int k = 1;
        for (; k < n && i + k < bytes.size(); ++k) {
            auto b = static_cast<unsigned char>(bytes[i + k]);
            if (k == 1 ? (b < low || b > high) : (b & 0xC0) != 0x80) break;
        }
        if (k == n) out.append(bytes.substr(i, static_cast<size_t>(n)));
        else out += replacement_character;
        i += static_cast<size_t>(k);
    }
    return out;
}

inline bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }
inline bool ends_with_replacement(std::string_view text) { return ends_with(text, replacement_character); }

}  // namespace detail

// ---- Unicode tables -------------------------------------------------------------------------------------------------
// The regex's \p{L}, \p{N}, \s and the NFC normalizer need Unicode data. A script writes it here as compact range
// tables, so the header stays self-contained; rerun it to move to another Unicode version.

namespace detail::unicode {

// clang-format off
// ---- BEGIN GENERATED UNICODE TABLES (scripts/make_unicode_tables.py, Unicode 14.0.0; do not edit by hand) -----------
// General category L (Lu Ll Lt Lm Lo): \p{L}: 648 ranges, first and last code point of each.
inline constexpr char32_t letter_ranges[][2] = {
    {0x41,0x5A},{0x61,0x7A},{0xAA,0xAA},{0xB5,0xB5},{0xBA,0xBA},{0xC0,0xD6},{0xD8,0xF6},{0xF8,0x2C1},{0x2C6,0x2D1},{0x2E0,0x2E4},
    {0x2EC,0x2EC},{0x2EE,0x2EE},{0x370,0x374},{0x376,0x377},{0x37A,0x37D},{0x37F,0x37F},{0x386,0x386},{0x388,0x38A},{0x38C,0x38C},{0x38E,0x3A1},
    {0x3A3,0x3F5},{0x3F7,0x481},{0x48A,0x52F},{0x531,0x556},{0x559,0x559},{0x560,0x588},{0x5D0,0x5EA},{0x5EF,0x5F2},{0x620,0x64A},{0x66E,0x66F},
    {0x671,0x6D3},{0x6D5,0x6D5},{0x6E5,0x6E6},{0x6EE,0x6EF},{0x6FA,0x6FC},{0x6FF,0x6FF},{0x710,0x710},{0x712,0x72F},{0x74D,0x7A5},{0x7B1,0x7B1},
    {0x7CA,0x7EA},{0x7F4,0x7F5},{0x7FA,0x7FA},{0x800,0x815},{0x81A,0x81A},{0x824,0x824},{0x828,0x828},{0x840,0x858},{0x860,0x86A},{0x870,0x887},
    {0x889,0x88E},{0x8A0,0x8C9},{0x904,0x939},{0x93D,0x93D},{0x950,0x950},{0x958,0x961},{0x971,0x980},{0x985,0x98C},{0x98F,0x990},{0x993,0x9A8},
    {0x9AA,0x9B0},{0x9B2,0x9B2},{0x9B6,0x9B9},{0x9BD,0x9BD},{0x9CE,0x9CE},{0x9DC,0x9DD},{0x9DF,0x9E1},{0x9F0,0x9F1},{0x9FC,0x9FC},{0xA05,0xA0A},
    {0xA0F,0xA10},{0xA13,0xA28},{0xA2A,0xA30},{0xA32,0xA33},{0xA35,0xA36},{0xA38,0xA39},{0xA59,0xA5C},{0xA5E,0xA5E},{0xA72,0xA74},{0xA85,0xA8D},
    {0xA8F,0xA91},{0xA93,0xAA8},{0xAAA,0xAB0},{0xAB2,0xAB3},{0xAB5,0xAB9},{0xABD,0xABD},{0xAD0,0xAD0},{0xAE0,0xAE1},{0xAF9,0xAF9},{0xB05,0xB0C},
    {0xB0F,0xB10},{0xB13,0xB28},{0xB2A,0xB30},{0xB32,0xB33},{0xB35,0xB39},{0xB3D,0xB3D},{0xB5C,0xB5D},{0xB5F,0xB61},{0xB71,0xB71},{0xB83,0xB83},
    {0xB85,0xB8A},{0xB8E,0xB90},{0xB92,0xB95},{0xB99,0xB9A},{0xB9C,0xB9C},{0xB9E,0xB9F},{0xBA3,0xBA4},{0xBA8,0xBAA},{0xBAE,0xBB9},{0xBD0,0xBD0},
    {0xC05,0xC0C},{0xC0E,0xC10},{0xC12,0xC28},{0xC2A,0xC39},{0xC3D,0xC3D},{0xC58,0xC5A},{0xC5D,0xC5D},{0xC60,0xC61},{0xC80,0xC80},{0xC85,0xC8C},
    {0xC8E,0xC90},{0xC92,0xCA8},{0xCAA,0xCB3},{0xCB5,0xCB9},{0xCBD,0xCBD},{0xCDD,0xCDE},{0xCE0,0xCE1},{0xCF1,0xCF2},{0xD04,0xD0C},{0xD0E,0xD10},
    {0xD12,0xD3A},{0xD3D,0xD3D},{0xD4E,0xD4E},{0xD54,0xD56},{0xD5F,0xD61},{0xD7A,0xD7F},{0xD85,0xD96},{0xD9A,0xDB1},{0xDB3,0xDBB},{0xDBD,0xDBD},
    {0xDC0,0xDC6},{0xE01,0xE30},{0xE32,0xE33},{0xE40,0xE46},{0xE81,0xE82},{0xE84,0xE84},{0xE86,0xE8A},{0xE8C,0xEA3},{0xEA5,0xEA5},{0xEA7,0xEB0},
    {0xEB2,0xEB3},{0xEBD,0xEBD},{0xEC0,0xEC4},{0xEC6,0xEC6},{0xEDC,0xEDF},{0xF00,0xF00},{0xF40,0xF47},{0xF49,0xF6C},{0xF88,0xF8C},{0x1000,0x102A},
    {0x103F,0x103F},{0x1050,0x1055},{0x105A,0x105D},{0x1061,0x1061},{0x1065,0x1066},{0x106E,0x1070},{0x1075,0x1081},{0x108E,0x108E},{0x10A0,0x10C5},{0x10C7,0x10C7},
    {0x10CD,0x10CD},{0x10D0,0x10FA},{0x10FC,0x1248},{0x124A,0x124D},{0x1250,0x1256},{0x1258,0x1258},{0x125A,0x125D},{0x1260,0x1288},{0x128A,0x128D},{0x1290,0x12B0},
    {0x12B2,0x12B5},{0x12B8,0x12BE},{0x12C0,0x12C0},{0x12C2,0x12C5},{0x12C8,0x12D6},{0x12D8,0x1310},{0x1312,0x1315},{0x1318,0x135A},{0x1380,0x138F},{0x13A0,0x13F5},
    {0x13F8,0x13FD},{0x1401,0x166C},{0x166F,0x167F},{0x1681,0x169A},{0x16A0,0x16EA},{0x16F1,0x16F8},{0x1700,0x1711},{0x171F,0x1731},{0x1740,0x1751},{0x1760,0x176C},
    {0x176E,0x1770},{0x1780,0x17B3},{0x17D7,0x17D7},{0x17DC,0x17DC},{0x1820,0x1878},{0x1880,0x1884},{0x1887,0x18A8},{0x18AA,0x18AA},{0x18B0,0x18F5},{0x1900,0x191E},
    {0x1950,0x196D},{0x1970,0x1974},{0x1980,0x19AB},{0x19B0,0x19C9},{0x1A00,0x1A16},{0x1A20,0x1A54},{0x1AA7,0x1AA7},{0x1B05,0x1B33},{0x1B45,0x1B4C},{0x1B83,0x1BA0},
    {0x1BAE,0x1BAF},{0x1BBA,0x1BE5},{0x1C00,0x1C23},{0x1C4D,0x1C4F},{0x1C5A,0x1C7D},{0x1C80,0x1C88},{0x1C90,0x1CBA},{0x1CBD,0x1CBF},{0x1CE9,0x1CEC},{0x1CEE,0x1CF3},
    {0x1CF5,0x1CF6},{0x1CFA,0x1CFA},{0x1D00,0x1DBF},{0x1E00,0x1F15},{0x1F18,0x1F1D},{0x1F20,0x1F45},{0x1F48,0x1F4D},{0x1F50,0x1F57},{0x1F59,0x1F59},{0x1F5B,0x1F5B},
    {0x1F5D,0x1F5D},{0x1F5F,0x1F7D},{0x1F80,0x1FB4},{0x1FB6,0x1FBC},{0x1FBE,0x1FBE},{0x1FC2,0x1FC4},{0x1FC6,0x1FCC},{0x1FD0,0x1FD3},{0x1FD6,0x1FDB},{0x1FE0,0x1FEC},
    {0x1FF2,0x1FF4},{0x1FF6,0x1FFC},{0x2071,0x2071},{0x207F,0x207F},{0x2090,0x209C},{0x2102,0x2102},{0x2107,0x2107},{0x210A,0x2113},{0x2115,0x2115},{0x2119,0x211D},
    {0x2124,0x2124},{0x2126,0x2126},{0x2128,0x2128},{0x212A,0x212D},{0x212F,0x2139},{0x213C,0x213F},{0x2145,0x2149},{0x214E,0x214E},{0x2183,0x2184},{0x2C00,0x2CE4},
    {0x2CEB,0x2CEE},{0x2CF2,0x2CF3},{0x2D00,0x2D25},{0x2D27,0x2D27},{0x2D2D,0x2D2D},{0x2D30,0x2D67},{0x2D6F,0x2D6F},{0x2D80,0x2D96},{0x2DA0,0x2DA6},{0x2DA8,0x2DAE},
    {0x2DB0,0x2DB6},{0x2DB8,0x2DBE},{0x2DC0,0x2DC6},{0x2DC8,0x2DCE},{0x2DD0,0x2DD6},{0x2DD8,0x2DDE},{0x2E2F,0x2E2F},{0x3005,0x3006},{0x3031,0x3035},{0x303B,0x303C},
    {0x3041,0x3096},{0x309D,0x309F},{0x30A1,0x30FA},{0x30FC,0x30FF},{0x3105,0x312F},{0x3131,0x318E},{0x31A0,0x31BF},{0x31F0,0x31FF},{0x3400,0x4DBF},{0x4E00,0xA48C},
    {0xA4D0,0xA4FD},{0xA500,0xA60C},{0xA610,0xA61F},{0xA62A,0xA62B},{0xA640,0xA66E},{0xA67F,0xA69D},{0xA6A0,0xA6E5},{0xA717,0xA71F},{0xA722,0xA788},{0xA78B,0xA7CA},
    {0xA7D0,0xA7D1},{0xA7D3,0xA7D3},{0xA7D5,0xA7D9},{0xA7F2,0xA801},{0xA803,0xA805},{0xA807,0xA80A},{0xA80C,0xA822},{0xA840,0xA873},{0xA882,0xA8B3},{0xA8F2,0xA8F7},
    {0xA8FB,0xA8FB},{0xA8FD,0xA8FE},{0xA90A,0xA925},{0xA930,0xA946},{0xA960,0xA97C},{0xA984,0xA9B2},{0xA9CF,0xA9CF},{0xA9E0,0xA9E4},{0xA9E6,0xA9EF},{0xA9FA,0xA9FE},
    {0xAA00,0xAA28},{0xAA40,0xAA42},{0xAA44,0xAA4B},{0xAA60,0xAA76},{0xAA7A,0xAA7A},{0xAA7E,0xAAAF},{0xAAB1,0xAAB1},{0xAAB5,0xAAB6},{0xAAB9,0xAABD},{0xAAC0,0xAAC0},
    {0xAAC2,0xAAC2},{0xAADB,0xAADD},{0xAAE0,0xAAEA},{0xAAF2,0xAAF4},{0xAB01,0xAB06},{0xAB09,0xAB0E},{0xAB11,0xAB16},{0xAB20,0xAB26},{0xAB28,0xAB2E},{0xAB30,0xAB5A},
    {0xAB5C,0xAB69},{0xAB70,0xABE2},{0xAC00,0xD7A3},{0xD7B0,0xD7C6},{0xD7CB,0xD7FB},{0xF900,0xFA6D},{0xFA70,0xFAD9},{0xFB00,0xFB06},{0xFB13,0xFB17},{0xFB1D,0xFB1D},
    {0xFB1F,0xFB28},{0xFB2A,0xFB36},{0xFB38,0xFB3C},{0xFB3E,0xFB3E},{0xFB40,0xFB41},{0xFB43,0xFB44},{0xFB46,0xFBB1},{0xFBD3,0xFD3D},{0xFD50,0xFD8F},{0xFD92,0xFDC7},
    {0xFDF0,0xFDFB},{0xFE70,0xFE74},{0xFE76,0xFEFC},{0xFF21,0xFF3A},{0xFF41,0xFF5A},{0xFF66,0xFFBE},{0xFFC2,0xFFC7},{0xFFCA,0xFFCF},{0xFFD2,0xFFD7},{0xFFDA,0xFFDC},
    {0x10000,0x1000B},{0x1000D,0x10026},{0x10028,0x1003A},{0x1003C,0x1003D},{0x1003F,0x1004D},{0x10050,0x1005D},{0x10080,0x100FA},{0x10280,0x1029C},{0x102A0,0x102D0},{0x10300,0x1031F},
    {0x1032D,0x10340},{0x10342,0x10349},{0x10350,0x10375},{0x10380,0x1039D},{0x103A0,0x103C3},{0x103C8,0x103CF},{0x10400,0x1049D},{0x104B0,0x104D3},{0x104D8,0x104FB},{0x10500,0x10527},
    {0x10530,0x10563},{0x10570,0x1057A},{0x1057C,0x1058A},{0x1058C,0x10592},{0x10594,0x10595},{0x10597,0x105A1},{0x105A3,0x105B1},{0x105B3,0x105B9},{0x105BB,0x105BC},{0x10600,0x10736},
    {0x10740,0x10755},{0x10760,0x10767},{0x10780,0x10785},{0x10787,0x107B0},{0x107B2,0x107BA},{0x10800,0x10805},{0x10808,0x10808},{0x1080A,0x10835},{0x10837,0x10838},{0x1083C,0x1083C},
    {0x1083F,0x10855},{0x10860,0x10876},{0x10880,0x1089E},{0x108E0,0x108F2},{0x108F4,0x108F5},{0x10900,0x10915},{0x10920,0x10939},{0x10980,0x109B7},{0x109BE,0x109BF},{0x10A00,0x10A00},
    {0x10A10,0x10A13},{0x10A15,0x10A17},{0x10A19,0x10A35},{0x10A60,0x10A7C},{0x10A80,0x10A9C},{0x10AC0,0x10AC7},{0x10AC9,0x10AE4},{0x10B00,0x10B35},{0x10B40,0x10B55},{0x10B60,0x10B72},
    {0x10B80,0x10B91},{0x10C00,0x10C48},{0x10C80,0x10CB2},{0x10CC0,0x10CF2},{0x10D00,0x10D23},{0x10E80,0x10EA9},{0x10EB0,0x10EB1},{0x10F00,0x10F1C},{0x10F27,0x10F27},{0x10F30,0x10F45},
    {0x10F70,0x10F81},{0x10FB0,0x10FC4},{0x10FE0,0x10FF6},{0x11003,0x11037},{0x11071,0x11072},{0x11075,0x11075},{0x11083,0x110AF},{0x110D0,0x110E8},{0x11103,0x11126},{0x11144,0x11144},
    {0x11147,0x11147},{0x11150,0x11172},{0x11176,0x11176},{0x11183,0x111B2},{0x111C1,0x111C4},{0x111DA,0x111DA},{0x111DC,0x111DC},{0x11200,0x11211},{0x11213,0x1122B},{0x11280,0x11286},
    {0x11288,0x11288},{0x1128A,0x1128D},{0x1128F,0x1129D},{0x1129F,0x112A8},{0x112B0,0x112DE},{0x11305,0x1130C},{0x1130F,0x11310},{0x11313,0x11328},{0x1132A,0x11330},{0x11332,0x11333},
    {0x11335,0x11339},{0x1133D,0x1133D},{0x11350,0x11350},{0x1135D,0x11361},{0x11400,0x11434},{0x11447,0x1144A},{0x1145F,0x11461},{0x11480,0x114AF},{0x114C4,0x114C5},{0x114C7,0x114C7},
    {0x11580,0x115AE},{0x115D8,0x115DB},{0x11600,0x1162F},{0x11644,0x11644},{0x11680,0x116AA},{0x116B8,0x116B8},{0x11700,0x1171A},{0x11740,0x11746},{0x11800,0x1182B},{0x118A0,0x118DF},
    {0x118FF,0x11906},{0x11909,0x11909},{0x1190C,0x11913},{0x11915,0x11916},{0x11918,0x1192F},{0x1193F,0x1193F},{0x11941,0x11941},{0x119A0,0x119A7},{0x119AA,0x119D0},{0x119E1,0x119E1},
    {0x119E3,0x119E3},{0x11A00,0x11A00},{0x11A0B,0x11A32},{0x11A3A,0x11A3A},{0x11A50,0x11A50},{0x11A5C,0x11A89},{0x11A9D,0x11A9D},{0x11AB0,0x11AF8},{0x11C00,0x11C08},{0x11C0A,0x11C2E},
    {0x11C40,0x11C40},{0x11C72,0x11C8F},{0x11D00,0x11D06},{0x11D08,0x11D09},{0x11D0B,0x11D30},{0x11D46,0x11D46},{0x11D60,0x11D65},{0x11D67,0x11D68},{0x11D6A,0x11D89},{0x11D98,0x11D98},
    {0x11EE0,0x11EF2},{0x11FB0,0x11FB0},{0x12000,0x12399},{0x12480,0x12543},{0x12F90,0x12FF0},{0x13000,0x1342E},{0x14400,0x14646},{0x16800,0x16A38},{0x16A40,0x16A5E},{0x16A70,0x16ABE},
    {0x16AD0,0x16AED},{0x16B00,0x16B2F},{0x16B40,0x16B43},{0x16B63,0x16B77},{0x16B7D,0x16B8F},{0x16E40,0x16E7F},{0x16F00,0x16F4A},{0x16F50,0x16F50},{0x16F93,0x16F9F},{0x16FE0,0x16FE1},
    {0x16FE3,0x16FE3},{0x17000,0x187F7},{0x18800,0x18CD5},{0x18D00,0x18D08},{0x1AFF0,0x1AFF3},{0x1AFF5,0x1AFFB},{0x1AFFD,0x1AFFE},{0x1B000,0x1B122},{0x1B150,0x1B152},{0x1B164,0x1B167},
    {0x1B170,0x1B2FB},{0x1BC00,0x1BC6A},{0x1BC70,0x1BC7C},{0x1BC80,0x1BC88},{0x1BC90,0x1BC99},{0x1D400,0x1D454},{0x1D456,0x1D49C},{0x1D49E,0x1D49F},{0x1D4A2,0x1D4A2},{0x1D4A5,0x1D4A6},
    {0x1D4A9,0x1D4AC},{0x1D4AE,0x1D4B9},{0x1D4BB,0x1D4BB},{0x1D4BD,0x1D4C3},{0x1D4C5,0x1D505},{0x1D507,0x1D50A},{0x1D50D,0x1D514},{0x1D516,0x1D51C},{0x1D51E,0x1D539},{0x1D53B,0x1D53E},
    {0x1D540,0x1D544},{0x1D546,0x1D546},{0x1D54A,0x1D550},{0x1D552,0x1D6A5},{0x1D6A8,0x1D6C0},{0x1D6C2,0x1D6DA},{0x1D6DC,0x1D6FA},{0x1D6FC,0x1D714},{0x1D716,0x1D734},{0x1D736,0x1D74E},
    {0x1D750,0x1D76E},{0x1D770,0x1D788},{0x1D78A,0x1D7A8},{0x1D7AA,0x1D7C2},{0x1D7C4,0x1D7CB},{0x1DF00,0x1DF1E},{0x1E100,0x1E12C},{0x1E137,0x1E13D},{0x1E14E,0x1E14E},{0x1E290,0x1E2AD},
    {0x1E2C0,0x1E2EB},{0x1E7E0,0x1E7E6},{0x1E7E8,0x1E7EB},{0x1E7ED,0x1E7EE},{0x1E7F0,0x1E7FE},{0x1E800,0x1E8C4},{0x1E900,0x1E943},{0x1E94B,0x1E94B},{0x1EE00,0x1EE03},{0x1EE05,0x1EE1F},
    {0x1EE21,0x1EE22},{0x1EE24,0x1EE24},{0x1EE27,0x1EE27},{0x1EE29,0x1EE32},{0x1EE34,0x1EE37},{0x1EE39,0x1EE39},{0x1EE3B,0x1EE3B},{0x1EE42,0x1EE42},{0x1EE47,0x1EE47},{0x1EE49,0x1EE49},
    {0x1EE4B,0x1EE4B},{0x1EE4D,0x1EE4F},{0x1EE51,0x1EE52},{0x1EE54,0x1EE54},{0x1EE57,0x1EE57},{0x1EE59,0x1EE59},{0x1EE5B,0x1EE5B},{0x1EE5D,0x1EE5D},{0x1EE5F,0x1EE5F},{0x1EE61,0x1EE62},
    {0x1EE64,0x1EE64},{0x1EE67,0x1EE6A},{0x1EE6C,0x1EE72},{0x1EE74,0x1EE77},{0x1EE79,0x1EE7C},{0x1EE7E,0x1EE7E},{0x1EE80,0x1EE89},{0x1EE8B,0x1EE9B},{0x1EEA1,0x1EEA3},{0x1EEA5,0x1EEA9},
    {0x1EEAB,0x1EEBB},{0x20000,0x2A6DF},{0x2A700,0x2B738},{0x2B740,0x2B81D},{0x2B820,0x2CEA1},{0x2CEB0,0x2EBE0},{0x2F800,0x2FA1D},{0x30000,0x3134A},
};
// General category N (Nd Nl No): \p{N}: 134 ranges, first and last code point of each.
inline constexpr char32_t number_ranges[][2] = {
    {0x30,0x39},{0xB2,0xB3},{0xB9,0xB9},{0xBC,0xBE},{0x660,0x669},{0x6F0,0x6F9},{0x7C0,0x7C9},{0x966,0x96F},{0x9E6,0x9EF},{0x9F4,0x9F9},
    {0xA66,0xA6F},{0xAE6,0xAEF},{0xB66,0xB6F},{0xB72,0xB77},{0xBE6,0xBF2},{0xC66,0xC6F},{0xC78,0xC7E},{0xCE6,0xCEF},{0xD58,0xD5E},{0xD66,0xD78},
    {0xDE6,0xDEF},{0xE50,0xE59},{0xED0,0xED9},{0xF20,0xF33},{0x1040,0x1049},{0x1090,0x1099},{0x1369,0x137C},{0x16EE,0x16F0},{0x17E0,0x17E9},{0x17F0,0x17F9},
    {0x1810,0x1819},{0x1946,0x194F},{0x19D0,0x19DA},{0x1A80,0x1A89},{0x1A90,0x1A99},{0x1B50,0x1B59},{0x1BB0,0x1BB9},{0x1C40,0x1C49},{0x1C50,0x1C59},{0x2070,0x2070},
    {0x2074,0x2079},{0x2080,0x2089},{0x2150,0x2182},{0x2185,0x2189},{0x2460,0x249B},{0x24EA,0x24FF},{0x2776,0x2793},{0x2CFD,0x2CFD},{0x3007,0x3007},{0x3021,0x3029},
    {0x3038,0x303A},{0x3192,0x3195},{0x3220,0x3229},{0x3248,0x324F},{0x3251,0x325F},{0x3280,0x3289},{0x32B1,0x32BF},{0xA620,0xA629},{0xA6E6,0xA6EF},{0xA830,0xA835},
    {0xA8D0,0xA8D9},{0xA900,0xA909},{0xA9D0,0xA9D9},{0xA9F0,0xA9F9},{0xAA50,0xAA59},{0xABF0,0xABF9},{0xFF10,0xFF19},{0x10107,0x10133},{0x10140,0x10178},{0x1018A,0x1018B},
    {0x102E1,0x102FB},{0x10320,0x10323},{0x10341,0x10341},{0x1034A,0x1034A},{0x103D1,0x103D5},{0x104A0,0x104A9},{0x10858,0x1085F},{0x10879,0x1087F},{0x108A7,0x108AF},{0x108FB,0x108FF},
    {0x10916,0x1091B},{0x109BC,0x109BD},{0x109C0,0x109CF},{0x109D2,0x109FF},{0x10A40,0x10A48},{0x10A7D,0x10A7E},{0x10A9D,0x10A9F},{0x10AEB,0x10AEF},{0x10B58,0x10B5F},{0x10B78,0x10B7F},
    {0x10BA9,0x10BAF},{0x10CFA,0x10CFF},{0x10D30,0x10D39},{0x10E60,0x10E7E},{0x10F1D,0x10F26},{0x10F51,0x10F54},{0x10FC5,0x10FCB},{0x11052,0x1106F},{0x110F0,0x110F9},{0x11136,0x1113F},
    {0x111D0,0x111D9},{0x111E1,0x111F4},{0x112F0,0x112F9},{0x11450,0x11459},{0x114D0,0x114D9},{0x11650,0x11659},{0x116C0,0x116C9},{0x11730,0x1173B},{0x118E0,0x118F2},{0x11950,0x11959},
    {0x11C50,0x11C6C},{0x11D50,0x11D59},{0x11DA0,0x11DA9},{0x11FC0,0x11FD4},{0x12400,0x1246E},{0x16A60,0x16A69},{0x16AC0,0x16AC9},{0x16B50,0x16B59},{0x16B5B,0x16B61},{0x16E80,0x16E96},
    {0x1D2E0,0x1D2F3},{0x1D360,0x1D378},{0x1D7CE,0x1D7FF},{0x1E140,0x1E149},{0x1E2F0,0x1E2F9},{0x1E8C7,0x1E8CF},{0x1E950,0x1E959},{0x1EC71,0x1ECAB},{0x1ECAD,0x1ECAF},{0x1ECB1,0x1ECB4},
    {0x1ED01,0x1ED2D},{0x1ED2F,0x1ED3D},{0x1F100,0x1F10C},{0x1FBF0,0x1FBF9},
};
// General category M (Mn Mc Me): \p{M}: 299 ranges, first and last code point of each.
inline constexpr char32_t mark_ranges[][2] = {
    {0x300,0x36F},{0x483,0x489},{0x591,0x5BD},{0x5BF,0x5BF},{0x5C1,0x5C2},{0x5C4,0x5C5},{0x5C7,0x5C7},{0x610,0x61A},{0x64B,0x65F},{0x670,0x670},
    {0x6D6,0x6DC},{0x6DF,0x6E4},{0x6E7,0x6E8},{0x6EA,0x6ED},{0x711,0x711},{0x730,0x74A},{0x7A6,0x7B0},{0x7EB,0x7F3},{0x7FD,0x7FD},{0x816,0x819},
    {0x81B,0x823},{0x825,0x827},{0x829,0x82D},{0x859,0x85B},{0x898,0x89F},{0x8CA,0x8E1},{0x8E3,0x903},{0x93A,0x93C},{0x93E,0x94F},{0x951,0x957},
    {0x962,0x963},{0x981,0x983},{0x9BC,0x9BC},{0x9BE,0x9C4},{0x9C7,0x9C8},{0x9CB,0x9CD},{0x9D7,0x9D7},{0x9E2,0x9E3},{0x9FE,0x9FE},{0xA01,0xA03},
    {0xA3C,0xA3C},{0xA3E,0xA42},{0xA47,0xA48},{0xA4B,0xA4D},{0xA51,0xA51},{0xA70,0xA71},{0xA75,0xA75},{0xA81,0xA83},{0xABC,0xABC},{0xABE,0xAC5},
    {0xAC7,0xAC9},{0xACB,0xACD},{0xAE2,0xAE3},{0xAFA,0xAFF},{0xB01,0xB03},{0xB3C,0xB3C},{0xB3E,0xB44},{0xB47,0xB48},{0xB4B,0xB4D},{0xB55,0xB57},
    {0xB62,0xB63},{0xB82,0xB82},{0xBBE,0xBC2},{0xBC6,0xBC8},{0xBCA,0xBCD},{0xBD7,0xBD7},{0xC00,0xC04},{0xC3C,0xC3C},{0xC3E,0xC44},{0xC46,0xC48},
    {0xC4A,0xC4D},{0xC55,0xC56},{0xC62,0xC63},{0xC81,0xC83},{0xCBC,0xCBC},{0xCBE,0xCC4},{0xCC6,0xCC8},{0xCCA,0xCCD},{0xCD5,0xCD6},{0xCE2,0xCE3},
    {0xD00,0xD03},{0xD3B,0xD3C},{0xD3E,0xD44},{0xD46,0xD48},{0xD4A,0xD4D},{0xD57,0xD57},{0xD62,0xD63},{0xD81,0xD83},{0xDCA,0xDCA},{0xDCF,0xDD4},
    {0xDD6,0xDD6},{0xDD8,0xDDF},{0xDF2,0xDF3},{0xE31,0xE31},{0xE34,0xE3A},{0xE47,0xE4E},{0xEB1,0xEB1},{0xEB4,0xEBC},{0xEC8,0xECD},{0xF18,0xF19},
    {0xF35,0xF35},{0xF37,0xF37},{0xF39,0xF39},{0xF3E,0xF3F},{0xF71,0xF84},{0xF86,0xF87},{0xF8D,0xF97},{0xF99,0xFBC},{0xFC6,0xFC6},{0x102B,0x103E},
    {0x1056,0x1059},{0x105E,0x1060},{0x1062,0x1064},{0x1067,0x106D},{0x1071,0x1074},{0x1082,0x108D},{0x108F,0x108F},{0x109A,0x109D},{0x135D,0x135F},{0x1712,0x1715},
    {0x1732,0x1734},{0x1752,0x1753},{0x1772,0x1773},{0x17B4,0x17D3},{0x17DD,0x17DD},{0x180B,0x180D},{0x180F,0x180F},{0x1885,0x1886},{0x18A9,0x18A9},{0x1920,0x192B},
    {0x1930,0x193B},{0x1A17,0x1A1B},{0x1A55,0x1A5E},{0x1A60,0x1A7C},{0x1A7F,0x1A7F},{0x1AB0,0x1ACE},{0x1B00,0x1B04},{0x1B34,0x1B44},{0x1B6B,0x1B73},{0x1B80,0x1B82},
    {0x1BA1,0x1BAD},{0x1BE6,0x1BF3},{0x1C24,0x1C37},{0x1CD0,0x1CD2},{0x1CD4,0x1CE8},{0x1CED,0x1CED},{0x1CF4,0x1CF4},{0x1CF7,0x1CF9},{0x1DC0,0x1DFF},{0x20D0,0x20F0},
    {0x2CEF,0x2CF1},{0x2D7F,0x2D7F},{0x2DE0,0x2DFF},{0x302A,0x302F},{0x3099,0x309A},{0xA66F,0xA672},{0xA674,0xA67D},{0xA69E,0xA69F},{0xA6F0,0xA6F1},{0xA802,0xA802},
    {0xA806,0xA806},{0xA80B,0xA80B},{0xA823,0xA827},{0xA82C,0xA82C},{0xA880,0xA881},{0xA8B4,0xA8C5},{0xA8E0,0xA8F1},{0xA8FF,0xA8FF},{0xA926,0xA92D},{0xA947,0xA953},
    {0xA980,0xA983},{0xA9B3,0xA9C0},{0xA9E5,0xA9E5},{0xAA29,0xAA36},{0xAA43,0xAA43},{0xAA4C,0xAA4D},{0xAA7B,0xAA7D},{0xAAB0,0xAAB0},{0xAAB2,0xAAB4},{0xAAB7,0xAAB8},
    {0xAABE,0xAABF},{0xAAC1,0xAAC1},{0xAAEB,0xAAEF},{0xAAF5,0xAAF6},{0xABE3,0xABEA},{0xABEC,0xABED},{0xFB1E,0xFB1E},{0xFE00,0xFE0F},{0xFE20,0xFE2F},{0x101FD,0x101FD},
    {0x102E0,0x102E0},{0x10376,0x1037A},{0x10A01,0x10A03},{0x10A05,0x10A06},{0x10A0C,0x10A0F},{0x10A38,0x10A3A},{0x10A3F,0x10A3F},{0x10AE5,0x10AE6},{0x10D24,0x10D27},{0x10EAB,0x10EAC},
    {0x10F46,0x10F50},{0x10F82,0x10F85},{0x11000,0x11002},{0x11038,0x11046},{0x11070,0x11070},{0x11073,0x11074},{0x1107F,0x11082},{0x110B0,0x110BA},{0x110C2,0x110C2},{0x11100,0x11102},
    {0x11127,0x11134},{0x11145,0x11146},{0x11173,0x11173},{0x11180,0x11182},{0x111B3,0x111C0},{0x111C9,0x111CC},{0x111CE,0x111CF},{0x1122C,0x11237},{0x1123E,0x1123E},{0x112DF,0x112EA},
    {0x11300,0x11303},{0x1133B,0x1133C},{0x1133E,0x11344},{0x11347,0x11348},{0x1134B,0x1134D},{0x11357,0x11357},{0x11362,0x11363},{0x11366,0x1136C},{0x11370,0x11374},{0x11435,0x11446},
    {0x1145E,0x1145E},{0x114B0,0x114C3},{0x115AF,0x115B5},{0x115B8,0x115C0},{0x115DC,0x115DD},{0x11630,0x11640},{0x116AB,0x116B7},{0x1171D,0x1172B},{0x1182C,0x1183A},{0x11930,0x11935},
    {0x11937,0x11938},{0x1193B,0x1193E},{0x11940,0x11940},{0x11942,0x11943},{0x119D1,0x119D7},{0x119DA,0x119E0},{0x119E4,0x119E4},{0x11A01,0x11A0A},{0x11A33,0x11A39},{0x11A3B,0x11A3E},
    {0x11A47,0x11A47},{0x11A51,0x11A5B},{0x11A8A,0x11A99},{0x11C2F,0x11C36},{0x11C38,0x11C3F},{0x11C92,0x11CA7},{0x11CA9,0x11CB6},{0x11D31,0x11D36},{0x11D3A,0x11D3A},{0x11D3C,0x11D3D},
    {0x11D3F,0x11D45},{0x11D47,0x11D47},{0x11D8A,0x11D8E},{0x11D90,0x11D91},{0x11D93,0x11D97},{0x11EF3,0x11EF6},{0x16AF0,0x16AF4},{0x16B30,0x16B36},{0x16F4F,0x16F4F},{0x16F51,0x16F87},
    {0x16F8F,0x16F92},{0x16FE4,0x16FE4},{0x16FF0,0x16FF1},{0x1BC9D,0x1BC9E},{0x1CF00,0x1CF2D},{0x1CF30,0x1CF46},{0x1D165,0x1D169},{0x1D16D,0x1D172},{0x1D17B,0x1D182},{0x1D185,0x1D18B},
    {0x1D1AA,0x1D1AD},{0x1D242,0x1D244},{0x1DA00,0x1DA36},{0x1DA3B,0x1DA6C},{0x1DA75,0x1DA75},{0x1DA84,0x1DA84},{0x1DA9B,0x1DA9F},{0x1DAA1,0x1DAAF},{0x1E000,0x1E006},{0x1E008,0x1E018},
    {0x1E01B,0x1E021},{0x1E023,0x1E024},{0x1E026,0x1E02A},{0x1E130,0x1E136},{0x1E2AE,0x1E2AE},{0x1E2EC,0x1E2EF},{0x1E8D0,0x1E8D6},{0x1E944,0x1E94A},{0xE0100,0xE01EF},
};
// General category P: \p{P}: 189 ranges, first and last code point of each.
inline constexpr char32_t punctuation_ranges[][2] = {
    {0x21,0x23},{0x25,0x2A},{0x2C,0x2F},{0x3A,0x3B},{0x3F,0x40},{0x5B,0x5D},{0x5F,0x5F},{0x7B,0x7B},{0x7D,0x7D},{0xA1,0xA1},
    {0xA7,0xA7},{0xAB,0xAB},{0xB6,0xB7},{0xBB,0xBB},{0xBF,0xBF},{0x37E,0x37E},{0x387,0x387},{0x55A,0x55F},{0x589,0x58A},{0x5BE,0x5BE},
    {0x5C0,0x5C0},{0x5C3,0x5C3},{0x5C6,0x5C6},{0x5F3,0x5F4},{0x609,0x60A},{0x60C,0x60D},{0x61B,0x61B},{0x61D,0x61F},{0x66A,0x66D},{0x6D4,0x6D4},
    {0x700,0x70D},{0x7F7,0x7F9},{0x830,0x83E},{0x85E,0x85E},{0x964,0x965},{0x970,0x970},{0x9FD,0x9FD},{0xA76,0xA76},{0xAF0,0xAF0},{0xC77,0xC77},
    {0xC84,0xC84},{0xDF4,0xDF4},{0xE4F,0xE4F},{0xE5A,0xE5B},{0xF04,0xF12},{0xF14,0xF14},{0xF3A,0xF3D},{0xF85,0xF85},{0xFD0,0xFD4},{0xFD9,0xFDA},
    {0x104A,0x104F},{0x10FB,0x10FB},{0x1360,0x1368},{0x1400,0x1400},{0x166E,0x166E},{0x169B,0x169C},{0x16EB,0x16ED},{0x1735,0x1736},{0x17D4,0x17D6},{0x17D8,0x17DA},
    {0x1800,0x180A},{0x1944,0x1945},{0x1A1E,0x1A1F},{0x1AA0,0x1AA6},{0x1AA8,0x1AAD},{0x1B5A,0x1B60},{0x1B7D,0x1B7E},{0x1BFC,0x1BFF},{0x1C3B,0x1C3F},{0x1C7E,0x1C7F},
    {0x1CC0,0x1CC7},{0x1CD3,0x1CD3},{0x2010,0x2027},{0x2030,0x2043},{0x2045,0x2051},{0x2053,0x205E},{0x207D,0x207E},{0x208D,0x208E},{0x2308,0x230B},{0x2329,0x232A},
    {0x2768,0x2775},{0x27C5,0x27C6},{0x27E6,0x27EF},{0x2983,0x2998},{0x29D8,0x29DB},{0x29FC,0x29FD},{0x2CF9,0x2CFC},{0x2CFE,0x2CFF},{0x2D70,0x2D70},{0x2E00,0x2E2E},
    {0x2E30,0x2E4F},{0x2E52,0x2E5D},{0x3001,0x3003},{0x3008,0x3011},{0x3014,0x301F},{0x3030,0x3030},{0x303D,0x303D},{0x30A0,0x30A0},{0x30FB,0x30FB},{0xA4FE,0xA4FF},
    {0xA60D,0xA60F},{0xA673,0xA673},{0xA67E,0xA67E},{0xA6F2,0xA6F7},{0xA874,0xA877},{0xA8CE,0xA8CF},{0xA8F8,0xA8FA},{0xA8FC,0xA8FC},{0xA92E,0xA92F},{0xA95F,0xA95F},
    {0xA9C1,0xA9CD},{0xA9DE,0xA9DF},{0xAA5C,0xAA5F},{0xAADE,0xAADF},{0xAAF0,0xAAF1},{0xABEB,0xABEB},{0xFD3E,0xFD3F},{0xFE10,0xFE19},{0xFE30,0xFE52},{0xFE54,0xFE61},
    {0xFE63,0xFE63},{0xFE68,0xFE68},{0xFE6A,0xFE6B},{0xFF01,0xFF03},{0xFF05,0xFF0A},{0xFF0C,0xFF0F},{0xFF1A,0xFF1B},{0xFF1F,0xFF20},{0xFF3B,0xFF3D},{0xFF3F,0xFF3F},
    {0xFF5B,0xFF5B},{0xFF5D,0xFF5D},{0xFF5F,0xFF65},{0x10100,0x10102},{0x1039F,0x1039F},{0x103D0,0x103D0},{0x1056F,0x1056F},{0x10857,0x10857},{0x1091F,0x1091F},{0x1093F,0x1093F},
    {0x10A50,0x10A58},{0x10A7F,0x10A7F},{0x10AF0,0x10AF6},{0x10B39,0x10B3F},{0x10B99,0x10B9C},{0x10EAD,0x10EAD},{0x10F55,0x10F59},{0x10F86,0x10F89},{0x11047,0x1104D},{0x110BB,0x110BC},
    {0x110BE,0x110C1},{0x11140,0x11143},{0x11174,0x11175},{0x111C5,0x111C8},{0x111CD,0x111CD},{0x111DB,0x111DB},{0x111DD,0x111DF},{0x11238,0x1123D},{0x112A9,0x112A9},{0x1144B,0x1144F},
    {0x1145A,0x1145B},{0x1145D,0x1145D},{0x114C6,0x114C6},{0x115C1,0x115D7},{0x11641,0x11643},{0x11660,0x1166C},{0x116B9,0x116B9},{0x1173C,0x1173E},{0x1183B,0x1183B},{0x11944,0x11946},
    {0x119E2,0x119E2},{0x11A3F,0x11A46},{0x11A9A,0x11A9C},{0x11A9E,0x11AA2},{0x11C41,0x11C45},{0x11C70,0x11C71},{0x11EF7,0x11EF8},{0x11FFF,0x11FFF},{0x12470,0x12474},{0x12FF1,0x12FF2},
    {0x16A6E,0x16A6F},{0x16AF5,0x16AF5},{0x16B37,0x16B3B},{0x16B44,0x16B44},{0x16E97,0x16E9A},{0x16FE2,0x16FE2},{0x1BC9F,0x1BC9F},{0x1DA87,0x1DA8B},{0x1E95E,0x1E95F},
};
// White_Space: \s: 10 ranges, first and last code point of each.
inline constexpr char32_t white_space_ranges[][2] = {
    {0x9,0xD},{0x20,0x20},{0x85,0x85},{0xA0,0xA0},{0x1680,0x1680},{0x2000,0x200A},{0x2028,0x2029},{0x202F,0x202F},{0x205F,0x205F},{0x3000,0x3000},
};
// Canonical combining class (non-zero only): 382 runs of {first, last, class}.
inline constexpr char32_t combining_class_runs[][3] = {
    {0x300,0x314,230},{0x315,0x315,232},{0x316,0x319,220},{0x31A,0x31A,232},{0x31B,0x31B,216},{0x31C,0x320,220},{0x321,0x322,202},{0x323,0x326,220},
    {0x327,0x328,202},{0x329,0x333,220},{0x334,0x338,1},{0x339,0x33C,220},{0x33D,0x344,230},{0x345,0x345,240},{0x346,0x346,230},{0x347,0x349,220},
    {0x34A,0x34C,230},{0x34D,0x34E,220},{0x350,0x352,230},{0x353,0x356,220},{0x357,0x357,230},{0x358,0x358,232},{0x359,0x35A,220},{0x35B,0x35B,230},
    {0x35C,0x35C,233},{0x35D,0x35E,234},{0x35F,0x35F,233},{0x360,0x361,234},{0x362,0x362,233},{0x363,0x36F,230},{0x483,0x487,230},{0x591,0x591,220},
    {0x592,0x595,230},{0x596,0x596,220},{0x597,0x599,230},{0x59A,0x59A,222},{0x59B,0x59B,220},{0x59C,0x5A1,230},{0x5A2,0x5A7,220},{0x5A8,0x5A9,230},
    {0x5AA,0x5AA,220},{0x5AB,0x5AC,230},{0x5AD,0x5AD,222},{0x5AE,0x5AE,228},{0x5AF,0x5AF,230},{0x5B0,0x5B0,10},{0x5B1,0x5B1,11},{0x5B2,0x5B2,12},
    {0x5B3,0x5B3,13},{0x5B4,0x5B4,14},{0x5B5,0x5B5,15},{0x5B6,0x5B6,16},{0x5B7,0x5B7,17},{0x5B8,0x5B8,18},{0x5B9,0x5BA,19},{0x5BB,0x5BB,20},
    {0x5BC,0x5BC,21},{0x5BD,0x5BD,22},{0x5BF,0x5BF,23},{0x5C1,0x5C1,24},{0x5C2,0x5C2,25},{0x5C4,0x5C4,230},{0x5C5,0x5C5,220},{0x5C7,0x5C7,18},
    {0x610,0x617,230},{0x618,0x618,30},{0x619,0x619,31},{0x61A,0x61A,32},{0x64B,0x64B,27},{0x64C,0x64C,28},{0x64D,0x64D,29},{0x64E,0x64E,30},
    {0x64F,0x64F,31},{0x650,0x650,32},{0x651,0x651,33},{0x652,0x652,34},{0x653,0x654,230},{0x655,0x656,220},{0x657,0x65B,230},{0x65C,0x65C,220},
    {0x65D,0x65E,230},{0x65F,0x65F,220},{0x670,0x670,35},{0x6D6,0x6DC,230},{0x6DF,0x6E2,230},{0x6E3,0x6E3,220},{0x6E4,0x6E4,230},{0x6E7,0x6E8,230},
    {0x6EA,0x6EA,220},{0x6EB,0x6EC,230},{0x6ED,0x6ED,220},{0x711,0x711,36},{0x730,0x730,230},{0x731,0x731,220},{0x732,0x733,230},{0x734,0x734,220},
    {0x735,0x736,230},{0x737,0x739,220},{0x73A,0x73A,230},{0x73B,0x73C,220},{0x73D,0x73D,230},{0x73E,0x73E,220},{0x73F,0x741,230},{0x742,0x742,220},
    {0x743,0x743,230},{0x744,0x744,220},{0x745,0x745,230},{0x746,0x746,220},{0x747,0x747,230},{0x748,0x748,220},{0x749,0x74A,230},{0x7EB,0x7F1,230},
    {0x7F2,0x7F2,220},{0x7F3,0x7F3,230},{0x7FD,0x7FD,220},{0x816,0x819,230},{0x81B,0x823,230},{0x825,0x827,230},{0x829,0x82D,230},{0x859,0x85B,220},
    {0x898,0x898,230},{0x899,0x89B,220},{0x89C,0x89F,230},{0x8CA,0x8CE,230},{0x8CF,0x8D3,220},{0x8D4,0x8E1,230},{0x8E3,0x8E3,220},{0x8E4,0x8E5,230},
    {0x8E6,0x8E6,220},{0x8E7,0x8E8,230},{0x8E9,0x8E9,220},{0x8EA,0x8EC,230},{0x8ED,0x8EF,220},{0x8F0,0x8F0,27},{0x8F1,0x8F1,28},{0x8F2,0x8F2,29},
    {0x8F3,0x8F5,230},{0x8F6,0x8F6,220},{0x8F7,0x8F8,230},{0x8F9,0x8FA,220},{0x8FB,0x8FF,230},{0x93C,0x93C,7},{0x94D,0x94D,9},{0x951,0x951,230},
    {0x952,0x952,220},{0x953,0x954,230},{0x9BC,0x9BC,7},{0x9CD,0x9CD,9},{0x9FE,0x9FE,230},{0xA3C,0xA3C,7},{0xA4D,0xA4D,9},{0xABC,0xABC,7},
    {0xACD,0xACD,9},{0xB3C,0xB3C,7},{0xB4D,0xB4D,9},{0xBCD,0xBCD,9},{0xC3C,0xC3C,7},{0xC4D,0xC4D,9},{0xC55,0xC55,84},{0xC56,0xC56,91},
    {0xCBC,0xCBC,7},{0xCCD,0xCCD,9},{0xD3B,0xD3C,9},{0xD4D,0xD4D,9},{0xDCA,0xDCA,9},{0xE38,0xE39,103},{0xE3A,0xE3A,9},{0xE48,0xE4B,107},
    {0xEB8,0xEB9,118},{0xEBA,0xEBA,9},{0xEC8,0xECB,122},{0xF18,0xF19,220},{0xF35,0xF35,220},{0xF37,0xF37,220},{0xF39,0xF39,216},{0xF71,0xF71,129},
    {0xF72,0xF72,130},{0xF74,0xF74,132},{0xF7A,0xF7D,130},{0xF80,0xF80,130},{0xF82,0xF83,230},{0xF84,0xF84,9},{0xF86,0xF87,230},{0xFC6,0xFC6,220},
    {0x1037,0x1037,7},{0x1039,0x103A,9},{0x108D,0x108D,220},{0x135D,0x135F,230},{0x1714,0x1715,9},{0x1734,0x1734,9},{0x17D2,0x17D2,9},{0x17DD,0x17DD,230},
    {0x18A9,0x18A9,228},{0x1939,0x1939,222},{0x193A,0x193A,230},{0x193B,0x193B,220},{0x1A17,0x1A17,230},{0x1A18,0x1A18,220},{0x1A60,0x1A60,9},{0x1A75,0x1A7C,230},
    {0x1A7F,0x1A7F,220},{0x1AB0,0x1AB4,230},{0x1AB5,0x1ABA,220},{0x1ABB,0x1ABC,230},{0x1ABD,0x1ABD,220},{0x1ABF,0x1AC0,220},{0x1AC1,0x1AC2,230},{0x1AC3,0x1AC4,220},
    {0x1AC5,0x1AC9,230},{0x1ACA,0x1ACA,220},{0x1ACB,0x1ACE,230},{0x1B34,0x1B34,7},{0x1B44,0x1B44,9},{0x1B6B,0x1B6B,230},{0x1B6C,0x1B6C,220},{0x1B6D,0x1B73,230},
    {0x1BAA,0x1BAB,9},{0x1BE6,0x1BE6,7},{0x1BF2,0x1BF3,9},{0x1C37,0x1C37,7},{0x1CD0,0x1CD2,230},{0x1CD4,0x1CD4,1},{0x1CD5,0x1CD9,220},{0x1CDA,0x1CDB,230},
    {0x1CDC,0x1CDF,220},{0x1CE0,0x1CE0,230},{0x1CE2,0x1CE8,1},{0x1CED,0x1CED,220},{0x1CF4,0x1CF4,230},{0x1CF8,0x1CF9,230},{0x1DC0,0x1DC1,230},{0x1DC2,0x1DC2,220},
    {0x1DC3,0x1DC9,230},{0x1DCA,0x1DCA,220},{0x1DCB,0x1DCC,230},{0x1DCD,0x1DCD,234},{0x1DCE,0x1DCE,214},{0x1DCF,0x1DCF,220},{0x1DD0,0x1DD0,202},{0x1DD1,0x1DF5,230},
    {0x1DF6,0x1DF6,232},{0x1DF7,0x1DF8,228},{0x1DF9,0x1DF9,220},{0x1DFA,0x1DFA,218},{0x1DFB,0x1DFB,230},{0x1DFC,0x1DFC,233},{0x1DFD,0x1DFD,220},{0x1DFE,0x1DFE,230},
    {0x1DFF,0x1DFF,220},{0x20D0,0x20D1,230},{0x20D2,0x20D3,1},{0x20D4,0x20D7,230},{0x20D8,0x20DA,1},{0x20DB,0x20DC,230},{0x20E1,0x20E1,230},{0x20E5,0x20E6,1},
    {0x20E7,0x20E7,230},{0x20E8,0x20E8,220},{0x20E9,0x20E9,230},{0x20EA,0x20EB,1},{0x20EC,0x20EF,220},{0x20F0,0x20F0,230},{0x2CEF,0x2CF1,230},{0x2D7F,0x2D7F,9},
    {0x2DE0,0x2DFF,230},{0x302A,0x302A,218},{0x302B,0x302B,228},{0x302C,0x302C,232},{0x302D,0x302D,222},{0x302E,0x302F,224},{0x3099,0x309A,8},{0xA66F,0xA66F,230},
    {0xA674,0xA67D,230},{0xA69E,0xA69F,230},{0xA6F0,0xA6F1,230},{0xA806,0xA806,9},{0xA82C,0xA82C,9},{0xA8C4,0xA8C4,9},{0xA8E0,0xA8F1,230},{0xA92B,0xA92D,220},
    {0xA953,0xA953,9},{0xA9B3,0xA9B3,7},{0xA9C0,0xA9C0,9},{0xAAB0,0xAAB0,230},{0xAAB2,0xAAB3,230},{0xAAB4,0xAAB4,220},{0xAAB7,0xAAB8,230},{0xAABE,0xAABF,230},
    {0xAAC1,0xAAC1,230},{0xAAF6,0xAAF6,9},{0xABED,0xABED,9},{0xFB1E,0xFB1E,26},{0xFE20,0xFE26,230},{0xFE27,0xFE2D,220},{0xFE2E,0xFE2F,230},{0x101FD,0x101FD,220},
    {0x102E0,0x102E0,220},{0x10376,0x1037A,230},{0x10A0D,0x10A0D,220},{0x10A0F,0x10A0F,230},{0x10A38,0x10A38,230},{0x10A39,0x10A39,1},{0x10A3A,0x10A3A,220},{0x10A3F,0x10A3F,9},
    {0x10AE5,0x10AE5,230},{0x10AE6,0x10AE6,220},{0x10D24,0x10D27,230},{0x10EAB,0x10EAC,230},{0x10F46,0x10F47,220},{0x10F48,0x10F4A,230},{0x10F4B,0x10F4B,220},{0x10F4C,0x10F4C,230},
    {0x10F4D,0x10F50,220},{0x10F82,0x10F82,230},{0x10F83,0x10F83,220},{0x10F84,0x10F84,230},{0x10F85,0x10F85,220},{0x11046,0x11046,9},{0x11070,0x11070,9},{0x1107F,0x1107F,9},
    {0x110B9,0x110B9,9},{0x110BA,0x110BA,7},{0x11100,0x11102,230},{0x11133,0x11134,9},{0x11173,0x11173,7},{0x111C0,0x111C0,9},{0x111CA,0x111CA,7},{0x11235,0x11235,9},
    {0x11236,0x11236,7},{0x112E9,0x112E9,7},{0x112EA,0x112EA,9},{0x1133B,0x1133C,7},{0x1134D,0x1134D,9},{0x11366,0x1136C,230},{0x11370,0x11374,230},{0x11442,0x11442,9},
    {0x11446,0x11446,7},{0x1145E,0x1145E,230},{0x114C2,0x114C2,9},{0x114C3,0x114C3,7},{0x115BF,0x115BF,9},{0x115C0,0x115C0,7},{0x1163F,0x1163F,9},{0x116B6,0x116B6,9},
    {0x116B7,0x116B7,7},{0x1172B,0x1172B,9},{0x11839,0x11839,9},{0x1183A,0x1183A,7},{0x1193D,0x1193E,9},{0x11943,0x11943,7},{0x119E0,0x119E0,9},{0x11A34,0x11A34,9},
    {0x11A47,0x11A47,9},{0x11A99,0x11A99,9},{0x11C3F,0x11C3F,9},{0x11D42,0x11D42,7},{0x11D44,0x11D45,9},{0x11D97,0x11D97,9},{0x16AF0,0x16AF4,1},{0x16B30,0x16B36,230},
    {0x16FF0,0x16FF1,6},{0x1BC9E,0x1BC9E,1},{0x1D165,0x1D166,216},{0x1D167,0x1D169,1},{0x1D16D,0x1D16D,226},{0x1D16E,0x1D172,216},{0x1D17B,0x1D182,220},{0x1D185,0x1D189,230},
    {0x1D18A,0x1D18B,220},{0x1D1AA,0x1D1AD,230},{0x1D242,0x1D244,230},{0x1E000,0x1E006,230},{0x1E008,0x1E018,230},{0x1E01B,0x1E021,230},{0x1E023,0x1E024,230},{0x1E026,0x1E02A,230},
    {0x1E130,0x1E136,230},{0x1E2AE,0x1E2AE,230},{0x1E2EC,0x1E2EF,230},{0x1E8D0,0x1E8D6,220},{0x1E944,0x1E949,230},{0x1E94A,0x1E94A,7},
};
// Canonical decompositions: 2061 entries of {code point (| 0x80000000 when NFC recomposes it), first, second (0: a singleton)}}, sorted by code point.
inline constexpr char32_t canonical_decompositions[][3] = {
    {0x800000C0,0x41,0x300},{0x800000C1,0x41,0x301},{0x800000C2,0x41,0x302},{0x800000C3,0x41,0x303},{0x800000C4,0x41,0x308},{0x800000C5,0x41,0x30A},
    {0x800000C7,0x43,0x327},{0x800000C8,0x45,0x300},{0x800000C9,0x45,0x301},{0x800000CA,0x45,0x302},{0x800000CB,0x45,0x308},{0x800000CC,0x49,0x300},
    {0x800000CD,0x49,0x301},{0x800000CE,0x49,0x302},{0x800000CF,0x49,0x308},{0x800000D1,0x4E,0x303},{0x800000D2,0x4F,0x300},{0x800000D3,0x4F,0x301},
    {0x800000D4,0x4F,0x302},{0x800000D5,0x4F,0x303},{0x800000D6,0x4F,0x308},{0x800000D9,0x55,0x300},{0x800000DA,0x55,0x301},{0x800000DB,0x55,0x302},
    {0x800000DC,0x55,0x308},{0x800000DD,0x59,0x301},{0x800000E0,0x61,0x300},{0x800000E1,0x61,0x301},{0x800000E2,0x61,0x302},{0x800000E3,0x61,0x303},
    {0x800000E4,0x61,0x308},{0x800000E5,0x61,0x30A},{0x800000E7,0x63,0x327},{0x800000E8,0x65,0x300},{0x800000E9,0x65,0x301},{0x800000EA,0x65,0x302},
    {0x800000EB,0x65,0x308},{0x800000EC,0x69,0x300},{0x800000ED,0x69,0x301},{0x800000EE,0x69,0x302},{0x800000EF,0x69,0x308},{0x800000F1,0x6E,0x303},
    {0x800000F2,0x6F,0x300},{0x800000F3,0x6F,0x301},{0x800000F4,0x6F,0x302},{0x800000F5,0x6F,0x303},{0x800000F6,0x6F,0x308},{0x800000F9,0x75,0x300},
    {0x800000FA,0x75,0x301},{0x800000FB,0x75,0x302},{0x800000FC,0x75,0x308},{0x800000FD,0x79,0x301},{0x800000FF,0x79,0x308},{0x80000100,0x41,0x304},
    {0x80000101,0x61,0x304},{0x80000102,0x41,0x306},{0x80000103,0x61,0x306},{0x80000104,0x41,0x328},{0x80000105,0x61,0x328},{0x80000106,0x43,0x301},
    {0x80000107,0x63,0x301},{0x80000108,0x43,0x302},{0x80000109,0x63,0x302},{0x8000010A,0x43,0x307},{0x8000010B,0x63,0x307},{0x8000010C,0x43,0x30C},
    {0x8000010D,0x63,0x30C},{0x8000010E,0x44,0x30C},{0x8000010F,0x64,0x30C},{0x80000112,0x45,0x304},{0x80000113,0x65,0x304},{0x80000114,0x45,0x306},
    {0x80000115,0x65,0x306},{0x80000116,0x45,0x307},{0x80000117,0x65,0x307},{0x80000118,0x45,0x328},{0x80000119,0x65,0x328},{0x8000011A,0x45,0x30C},
    {0x8000011B,0x65,0x30C},{0x8000011C,0x47,0x302},{0x8000011D,0x67,0x302},{0x8000011E,0x47,0x306},{0x8000011F,0x67,0x306},{0x80000120,0x47,0x307},
    {0x80000121,0x67,0x307},{0x80000122,0x47,0x327},{0x80000123,0x67,0x327},{0x80000124,0x48,0x302},{0x80000125,0x68,0x302},{0x80000128,0x49,0x303},
    {0x80000129,0x69,0x303},{0x8000012A,0x49,0x304},{0x8000012B,0x69,0x304},{0x8000012C,0x49,0x306},{0x8000012D,0x69,0x306},{0x8000012E,0x49,0x328},
    {0x8000012F,0x69,0x328},{0x80000130,0x49,0x307},{0x80000134,0x4A,0x302},{0x80000135,0x6A,0x302},{0x80000136,0x4B,0x327},{0x80000137,0x6B,0x327},
    {0x80000139,0x4C,0x301},{0x8000013A,0x6C,0x301},{0x8000013B,0x4C,0x327},{0x8000013C,0x6C,0x327},{0x8000013D,0x4C,0x30C},{0x8000013E,0x6C,0x30C},
    {0x80000143,0x4E,0x301},{0x80000144,0x6E,0x301},{0x80000145,0x4E,0x327},{0x80000146,0x6E,0x327},{0x80000147,0x4E,0x30C},{0x80000148,0x6E,0x30C},
    {0x8000014C,0x4F,0x304},{0x8000014D,0x6F,0x304},{0x8000014E,0x4F,0x306},{0x8000014F,0x6F,0x306},{0x80000150,0x4F,0x30B},{0x80000151,0x6F,0x30B},
    {0x80000154,0x52,0x301},{0x80000155,0x72,0x301},{0x80000156,0x52,0x327},{0x80000157,0x72,0x327},{0x80000158,0x52,0x30C},{0x80000159,0x72,0x30C},
    {0x8000015A,0x53,0x301},{0x8000015B,0x73,0x301},{0x8000015C,0x53,0x302},{0x8000015D,0x73,0x302},{0x8000015E,0x53,0x327},{0x8000015F,0x73,0x327},
    {0x80000160,0x53,0x30C},{0x80000161,0x73,0x30C},{0x80000162,0x54,0x327},{0x80000163,0x74,0x327},{0x80000164,0x54,0x30C},{0x80000165,0x74,0x30C},
    {0x80000168,0x55,0x303},{0x80000169,0x75,0x303},{0x8000016A,0x55,0x304},{0x8000016B,0x75,0x304},{0x8000016C,0x55,0x306},{0x8000016D,0x75,0x306},
    {0x8000016E,0x55,0x30A},{0x8000016F,0x75,0x30A},{0x80000170,0x55,0x30B},{0x80000171,0x75,0x30B},{0x80000172,0x55,0x328},{0x80000173,0x75,0x328},
    {0x80000174,0x57,0x302},{0x80000175,0x77,0x302},{0x80000176,0x59,0x302},{0x80000177,0x79,0x302},{0x80000178,0x59,0x308},{0x80000179,0x5A,0x301},
    {0x8000017A,0x7A,0x301},{0x8000017B,0x5A,0x307},{0x8000017C,0x7A,0x307},{0x8000017D,0x5A,0x30C},{0x8000017E,0x7A,0x30C},{0x800001A0,0x4F,0x31B},
    {0x800001A1,0x6F,0x31B},{0x800001AF,0x55,0x31B},{0x800001B0,0x75,0x31B},{0x800001CD,0x41,0x30C},{0x800001CE,0x61,0x30C},{0x800001CF,0x49,0x30C},
    {0x800001D0,0x69,0x30C},{0x800001D1,0x4F,0x30C},{0x800001D2,0x6F,0x30C},{0x800001D3,0x55,0x30C},{0x800001D4,0x75,0x30C},{0x800001D5,0xDC,0x304},
    {0x800001D6,0xFC,0x304},{0x800001D7,0xDC,0x301},{0x800001D8,0xFC,0x301},{0x800001D9,0xDC,0x30C},{0x800001DA,0xFC,0x30C},{0x800001DB,0xDC,0x300},
    {0x800001DC,0xFC,0x300},{0x800001DE,0xC4,0x304},{0x800001DF,0xE4,0x304},{0x800001E0,0x226,0x304},{0x800001E1,0x227,0x304},{0x800001E2,0xC6,0x304},
    {0x800001E3,0xE6,0x304},{0x800001E6,0x47,0x30C},{0x800001E7,0x67,0x30C},{0x800001E8,0x4B,0x30C},{0x800001E9,0x6B,0x30C},{0x800001EA,0x4F,0x328},
    {0x800001EB,0x6F,0x328},{0x800001EC,0x1EA,0x304},{0x800001ED,0x1EB,0x304},{0x800001EE,0x1B7,0x30C},{0x800001EF,0x292,0x30C},{0x800001F0,0x6A,0x30C},
    {0x800001F4,0x47,0x301},{0x800001F5,0x67,0x301},{0x800001F8,0x4E,0x300},{0x800001F9,0x6E,0x300},{0x800001FA,0xC5,0x301},{0x800001FB,0xE5,0x301},
    {0x800001FC,0xC6,0x301},{0x800001FD,0xE6,0x301},{0x800001FE,0xD8,0x301},{0x800001FF,0xF8,0x301},{0x80000200,0x41,0x30F},{0x80000201,0x61,0x30F},
    {0x80000202,0x41,0x311},{0x80000203,0x61,0x311},{0x80000204,0x45,0x30F},{0x80000205,0x65,0x30F},{0x80000206,0x45,0x311},{0x80000207,0x65,0x311},
    {0x80000208,0x49,0x30F},{0x80000209,0x69,0x30F},{0x8000020A,0x49,0x311},{0x8000020B,0x69,0x311},{0x8000020C,0x4F,0x30F},{0x8000020D,0x6F,0x30F},
    {0x8000020E,0x4F,0x311},{0x8000020F,0x6F,0x311},{0x80000210,0x52,0x30F},{0x80000211,0x72,0x30F},{0x80000212,0x52,0x311},{0x80000213,0x72,0x311},
    {0x80000214,0x55,0x30F},{0x80000215,0x75,0x30F},{0x80000216,0x55,0x311},{0x80000217,0x75,0x311},{0x80000218,0x53,0x326},{0x80000219,0x73,0x326},
    {0x8000021A,0x54,0x326},{0x8000021B,0x74,0x326},{0x8000021E,0x48,0x30C},{0x8000021F,0x68,0x30C},{0x80000226,0x41,0x307},{0x80000227,0x61,0x307},
    {0x80000228,0x45,0x327},{0x80000229,0x65,0x327},{0x8000022A,0xD6,0x304},{0x8000022B,0xF6,0x304},{0x8000022C,0xD5,0x304},{0x8000022D,0xF5,0x304},
    {0x8000022E,0x4F,0x307},{0x8000022F,0x6F,0x307},{0x80000230,0x22E,0x304},{0x80000231,0x22F,0x304},{0x80000232,0x59,0x304},{0x80000233,0x79,0x304},
    {0x340,0x300,0x0},{0x341,0x301,0x0},{0x343,0x313,0x0},{0x344,0x308,0x301},{0x374,0x2B9,0x0},{0x37E,0x3B,0x0},
    {0x80000385,0xA8,0x301},{0x80000386,0x391,0x301},{0x387,0xB7,0x0},{0x80000388,0x395,0x301},{0x80000389,0x397,0x301},{0x8000038A,0x399,0x301},
    {0x8000038C,0x39F,0x301},{0x8000038E,0x3A5,0x301},{0x8000038F,0x3A9,0x301},{0x80000390,0x3CA,0x301},{0x800003AA,0x399,0x308},{0x800003AB,0x3A5,0x308},
    {0x800003AC,0x3B1,0x301},{0x800003AD,0x3B5,0x301},{0x800003AE,0x3B7,0x301},{0x800003AF,0x3B9,0x301},{0x800003B0,0x3CB,0x301},{0x800003CA,0x3B9,0x308},
    {0x800003CB,0x3C5,0x308},{0x800003CC,0x3BF,0x301},{0x800003CD,0x3C5,0x301},{0x800003CE,0x3C9,0x301},{0x800003D3,0x3D2,0x301},{0x800003D4,0x3D2,0x308},
    {0x80000400,0x415,0x300},{0x80000401,0x415,0x308},{0x80000403,0x413,0x301},{0x80000407,0x406,0x308},{0x8000040C,0x41A,0x301},{0x8000040D,0x418,0x300},
    {0x8000040E,0x423,0x306},{0x80000419,0x418,0x306},{0x80000439,0x438,0x306},{0x80000450,0x435,0x300},{0x80000451,0x435,0x308},{0x80000453,0x433,0x301},
    {0x80000457,0x456,0x308},{0x8000045C,0x43A,0x301},{0x8000045D,0x438,0x300},{0x8000045E,0x443,0x306},{0x80000476,0x474,0x30F},{0x80000477,0x475,0x30F},
    {0x800004C1,0x416,0x306},{0x800004C2,0x436,0x306},{0x800004D0,0x410,0x306},{0x800004D1,0x430,0x306},{0x800004D2,0x410,0x308},{0x800004D3,0x430,0x308},
    {0x800004D6,0x415,0x306},{0x800004D7,0x435,0x306},{0x800004DA,0x4D8,0x308},{0x800004DB,0x4D9,0x308},{0x800004DC,0x416,0x308},{0x800004DD,0x436,0x308},
    {0x800004DE,0x417,0x308},{0x800004DF,0x437,0x308},{0x800004E2,0x418,0x304},{0x800004E3,0x438,0x304},{0x800004E4,0x418,0x308},{0x800004E5,0x438,0x308},
    {0x800004E6,0x41E,0x308},{0x800004E7,0x43E,0x308},{0x800004EA,0x4E8,0x308},{0x800004EB,0x4E9,0x308},{0x800004EC,0x42D,0x308},{0x800004ED,0x44D,0x308},
    {0x800004EE,0x423,0x304},{0x800004EF,0x443,0x304},{0x800004F0,0x423,0x308},{0x800004F1,0x443,0x308},{0x800004F2,0x423,0x30B},{0x800004F3,0x443,0x30B},
    {0x800004F4,0x427,0x308},{0x800004F5,0x447,0x308},{0x800004F8,0x42B,0x308},{0x800004F9,0x44B,0x308},{0x80000622,0x627,0x653},{0x80000623,0x627,0x654},
    {0x80000624,0x648,0x654},{0x80000625,0x627,0x655},{0x80000626,0x64A,0x654},{0x800006C0,0x6D5,0x654},{0x800006C2,0x6C1,0x654},{0x800006D3,0x6D2,0x654},
    {0x80000929,0x928,0x93C},{0x80000931,0x930,0x93C},{0x80000934,0x933,0x93C},{0x958,0x915,0x93C},{0x959,0x916,0x93C},{0x95A,0x917,0x93C},
    {0x95B,0x91C,0x93C},{0x95C,0x921,0x93C},{0x95D,0x922,0x93C},{0x95E,0x92B,0x93C},{0x95F,0x92F,0x93C},{0x800009CB,0x9C7,0x9BE},
    {0x800009CC,0x9C7,0x9D7},{0x9DC,0x9A1,0x9BC},{0x9DD,0x9A2,0x9BC},{0x9DF,0x9AF,0x9BC},{0xA33,0xA32,0xA3C},{0xA36,0xA38,0xA3C},
    {0xA59,0xA16,0xA3C},{0xA5A,0xA17,0xA3C},{0xA5B,0xA1C,0xA3C},{0xA5E,0xA2B,0xA3C},{0x80000B48,0xB47,0xB56},{0x80000B4B,0xB47,0xB3E},
    {0x80000B4C,0xB47,0xB57},{0xB5C,0xB21,0xB3C},{0xB5D,0xB22,0xB3C},{0x80000B94,0xB92,0xBD7},{0x80000BCA,0xBC6,0xBBE},{0x80000BCB,0xBC7,0xBBE},
    {0x80000BCC,0xBC6,0xBD7},{0x80000C48,0xC46,0xC56},{0x80000CC0,0xCBF,0xCD5},{0x80000CC7,0xCC6,0xCD5},{0x80000CC8,0xCC6,0xCD6},{0x80000CCA,0xCC6,0xCC2},
    {0x80000CCB,0xCCA,0xCD5},{0x80000D4A,0xD46,0xD3E},{0x80000D4B,0xD47,0xD3E},{0x80000D4C,0xD46,0xD57},{0x80000DDA,0xDD9,0xDCA},{0x80000DDC,0xDD9,0xDCF},
    {0x80000DDD,0xDDC,0xDCA},{0x80000DDE,0xDD9,0xDDF},{0xF43,0xF42,0xFB7},{0xF4D,0xF4C,0xFB7},{0xF52,0xF51,0xFB7},{0xF57,0xF56,0xFB7},
    {0xF5C,0xF5B,0xFB7},{0xF69,0xF40,0xFB5},{0xF73,0xF71,0xF72},{0xF75,0xF71,0xF74},{0xF76,0xFB2,0xF80},{0xF78,0xFB3,0xF80},
    {0xF81,0xF71,0xF80},{0xF93,0xF92,0xFB7},{0xF9D,0xF9C,0xFB7},{0xFA2,0xFA1,0xFB7},{0xFA7,0xFA6,0xFB7},{0xFAC,0xFAB,0xFB7},
    {0xFB9,0xF90,0xFB5},{0x80001026,0x1025,0x102E},{0x80001B06,0x1B05,0x1B35},{0x80001B08,0x1B07,0x1B35},{0x80001B0A,0x1B09,0x1B35},{0x80001B0C,0x1B0B,0x1B35},
    {0x80001B0E,0x1B0D,0x1B35},{0x80001B12,0x1B11,0x1B35},{0x80001B3B,0x1B3A,0x1B35},{0x80001B3D,0x1B3C,0x1B35},{0x80001B40,0x1B3E,0x1B35},{0x80001B41,0x1B3F,0x1B35},
    {0x80001B43,0x1B42,0x1B35},{0x80001E00,0x41,0x325},{0x80001E01,0x61,0x325},{0x80001E02,0x42,0x307},{0x80001E03,0x62,0x307},{0x80001E04,0x42,0x323},
    {0x80001E05,0x62,0x323},{0x80001E06,0x42,0x331},{0x80001E07,0x62,0x331},{0x80001E08,0xC7,0x301},{0x80001E09,0xE7,0x301},{0x80001E0A,0x44,0x307},
    {0x80001E0B,0x64,0x307},{0x80001E0C,0x44,0x323},{0x80001E0D,0x64,0x323},{0x80001E0E,0x44,0x331},{0x80001E0F,0x64,0x331},{0x80001E10,0x44,0x327},
    {0x80001E11,0x64,0x327},{0x80001E12,0x44,0x32D},{0x80001E13,0x64,0x32D},{0x80001E14,0x112,0x300},{0x80001E15,0x113,0x300},{0x80001E16,0x112,0x301},
    {0x80001E17,0x113,0x301},{0x80001E18,0x45,0x32D},{0x80001E19,0x65,0x32D},{0x80001E1A,0x45,0x330},{0x80001E1B,0x65,0x330},{0x80001E1C,0x228,0x306},
    {0x80001E1D,0x229,0x306},{0x80001E1E,0x46,0x307},{0x80001E1F,0x66,0x307},{0x80001E20,0x47,0x304},{0x80001E21,0x67,0x304},{0x80001E22,0x48,0x307},
    {0x80001E23,0x68,0x307},{0x80001E24,0x48,0x323},{0x80001E25,0x68,0x323},{0x80001E26,0x48,0x308},{0x80001E27,0x68,0x308},{0x80001E28,0x48,0x327},
    {0x80001E29,0x68,0x327},{0x80001E2A,0x48,0x32E},{0x80001E2B,0x68,0x32E},{0x80001E2C,0x49,0x330},{0x80001E2D,0x69,0x330},{0x80001E2E,0xCF,0x301},
    {0x80001E2F,0xEF,0x301},{0x80001E30,0x4B,0x301},{0x80001E31,0x6B,0x301},{0x80001E32,0x4B,0x323},{0x80001E33,0x6B,0x323},{0x80001E34,0x4B,0x331},
    {0x80001E35,0x6B,0x331},{0x80001E36,0x4C,0x323},{0x80001E37,0x6C,0x323},{0x80001E38,0x1E36,0x304},{0x80001E39,0x1E37,0x304},{0x80001E3A,0x4C,0x331},
    {0x80001E3B,0x6C,0x331},{0x80001E3C,0x4C,0x32D},{0x80001E3D,0x6C,0x32D},{0x80001E3E,0x4D,0x301},{0x80001E3F,0x6D,0x301},{0x80001E40,0x4D,0x307},
    {0x80001E41,0x6D,0x307},{0x80001E42,0x4D,0x323},{0x80001E43,0x6D,0x323},{0x80001E44,0x4E,0x307},{0x80001E45,0x6E,0x307},{0x80001E46,0x4E,0x323},
    {0x80001E47,0x6E,0x323},{0x80001E48,0x4E,0x331},{0x80001E49,0x6E,0x331},{0x80001E4A,0x4E,0x32D},{0x80001E4B,0x6E,0x32D},{0x80001E4C,0xD5,0x301},
    {0x80001E4D,0xF5,0x301},{0x80001E4E,0xD5,0x308},{0x80001E4F,0xF5,0x308},{0x80001E50,0x14C,0x300},{0x80001E51,0x14D,0x300},{0x80001E52,0x14C,0x301},
    {0x80001E53,0x14D,0x301},{0x80001E54,0x50,0x301},{0x80001E55,0x70,0x301},{0x80001E56,0x50,0x307},{0x80001E57,0x70,0x307},{0x80001E58,0x52,0x307},
    {0x80001E59,0x72,0x307},{0x80001E5A,0x52,0x323},{0x80001E5B,0x72,0x323},{0x80001E5C,0x1E5A,0x304},{0x80001E5D,0x1E5B,0x304},{0x80001E5E,0x52,0x331},
    {0x80001E5F,0x72,0x331},{0x80001E60,0x53,0x307},{0x80001E61,0x73,0x307},{0x80001E62,0x53,0x323},{0x80001E63,0x73,0x323},{0x80001E64,0x15A,0x307},
    {0x80001E65,0x15B,0x307},{0x80001E66,0x160,0x307},{0x80001E67,0x161,0x307},{0x80001E68,0x1E62,0x307},{0x80001E69,0x1E63,0x307},{0x80001E6A,0x54,0x307},
    {0x80001E6B,0x74,0x307},{0x80001E6C,0x54,0x323},{0x80001E6D,0x74,0x323},{0x80001E6E,0x54,0x331},{0x80001E6F,0x74,0x331},{0x80001E70,0x54,0x32D},
    {0x80001E71,0x74,0x32D},{0x80001E72,0x55,0x324},{0x80001E73,0x75,0x324},{0x80001E74,0x55,0x330},{0x80001E75,0x75,0x330},{0x80001E76,0x55,0x32D},
    {0x80001E77,0x75,0x32D},{0x80001E78,0x168,0x301},{0x80001E79,0x169,0x301},{0x80001E7A,0x16A,0x308},{0x80001E7B,0x16B,0x308},{0x80001E7C,0x56,0x303},
    {0x80001E7D,0x76,0x303},{0x80001E7E,0x56,0x323},{0x80001E7F,0x76,0x323},{0x80001E80,0x57,0x300},{0x80001E81,0x77,0x300},{0x80001E82,0x57,0x301},
    {0x80001E83,0x77,0x301},{0x80001E84,0x57,0x308},{0x80001E85,0x77,0x308},{0x80001E86,0x57,0x307},{0x80001E87,0x77,0x307},{0x80001E88,0x57,0x323},
    {0x80001E89,0x77,0x323},{0x80001E8A,0x58,0x307},{0x80001E8B,0x78,0x307},{0x80001E8C,0x58,0x308},{0x80001E8D,0x78,0x308},{0x80001E8E,0x59,0x307},
    {0x80001E8F,0x79,0x307},{0x80001E90,0x5A,0x302},{0x80001E91,0x7A,0x302},{0x80001E92,0x5A,0x323},{0x80001E93,0x7A,0x323},{0x80001E94,0x5A,0x331},
    {0x80001E95,0x7A,0x331},{0x80001E96,0x68,0x331},{0x80001E97,0x74,0x308},{0x80001E98,0x77,0x30A},{0x80001E99,0x79,0x30A},{0x80001E9B,0x17F,0x307},
    {0x80001EA0,0x41,0x323},{0x80001EA1,0x61,0x323},{0x80001EA2,0x41,0x309},{0x80001EA3,0x61,0x309},{0x80001EA4,0xC2,0x301},{0x80001EA5,0xE2,0x301},
    {0x80001EA6,0xC2,0x300},{0x80001EA7,0xE2,0x300},{0x80001EA8,0xC2,0x309},{0x80001EA9,0xE2,0x309},{0x80001EAA,0xC2,0x303},{0x80001EAB,0xE2,0x303},
    {0x80001EAC,0x1EA0,0x302},{0x80001EAD,0x1EA1,0x302},{0x80001EAE,0x102,0x301},{0x80001EAF,0x103,0x301},{0x80001EB0,0x102,0x300},{0x80001EB1,0x103,0x300},
    {0x80001EB2,0x102,0x309},{0x80001EB3,0x103,0x309},{0x80001EB4,0x102,0x303},{0x80001EB5,0x103,0x303},{0x80001EB6,0x1EA0,0x306},{0x80001EB7,0x1EA1,0x306},
    {0x80001EB8,0x45,0x323},{0x80001EB9,0x65,0x323},{0x80001EBA,0x45,0x309},{0x80001EBB,0x65,0x309},{0x80001EBC,0x45,0x303},{0x80001EBD,0x65,0x303},
    {0x80001EBE,0xCA,0x301},{0x80001EBF,0xEA,0x301},{0x80001EC0,0xCA,0x300},{0x80001EC1,0xEA,0x300},{0x80001EC2,0xCA,0x309},{0x80001EC3,0xEA,0x309},
    {0x80001EC4,0xCA,0x303},{0x80001EC5,0xEA,0x303},{0x80001EC6,0x1EB8,0x302},{0x80001EC7,0x1EB9,0x302},{0x80001EC8,0x49,0x309},{0x80001EC9,0x69,0x309},
    {0x80001ECA,0x49,0x323},{0x80001ECB,0x69,0x323},{0x80001ECC,0x4F,0x323},{0x80001ECD,0x6F,0x323},{0x80001ECE,0x4F,0x309},{0x80001ECF,0x6F,0x309},
    {0x80001ED0,0xD4,0x301},{0x80001ED1,0xF4,0x301},{0x80001ED2,0xD4,0x300},{0x80001ED3,0xF4,0x300},{0x80001ED4,0xD4,0x309},{0x80001ED5,0xF4,0x309},
    {0x80001ED6,0xD4,0x303},{0x80001ED7,0xF4,0x303},{0x80001ED8,0x1ECC,0x302},{0x80001ED9,0x1ECD,0x302},{0x80001EDA,0x1A0,0x301},{0x80001EDB,0x1A1,0x301},
    {0x80001EDC,0x1A0,0x300},{0x80001EDD,0x1A1,0x300},{0x80001EDE,0x1A0,0x309},{0x80001EDF,0x1A1,0x309},{0x80001EE0,0x1A0,0x303},{0x80001EE1,0x1A1,0x303},
    {0x80001EE2,0x1A0,0x323},{0x80001EE3,0x1A1,0x323},{0x80001EE4,0x55,0x323},{0x80001EE5,0x75,0x323},{0x80001EE6,0x55,0x309},{0x80001EE7,0x75,0x309},
    {0x80001EE8,0x1AF,0x301},{0x80001EE9,0x1B0,0x301},{0x80001EEA,0x1AF,0x300},{0x80001EEB,0x1B0,0x300},{0x80001EEC,0x1AF,0x309},{0x80001EED,0x1B0,0x309},
    {0x80001EEE,0x1AF,0x303},{0x80001EEF,0x1B0,0x303},{0x80001EF0,0x1AF,0x323},{0x80001EF1,0x1B0,0x323},{0x80001EF2,0x59,0x300},{0x80001EF3,0x79,0x300},
    {0x80001EF4,0x59,0x323},{0x80001EF5,0x79,0x323},{0x80001EF6,0x59,0x309},{0x80001EF7,0x79,0x309},{0x80001EF8,0x59,0x303},{0x80001EF9,0x79,0x303},
    {0x80001F00,0x3B1,0x313},{0x80001F01,0x3B1,0x314},{0x80001F02,0x1F00,0x300},{0x80001F03,0x1F01,0x300},{0x80001F04,0x1F00,0x301},{0x80001F05,0x1F01,0x301},
    {0x80001F06,0x1F00,0x342},{0x80001F07,0x1F01,0x342},{0x80001F08,0x391,0x313},{0x80001F09,0x391,0x314},{0x80001F0A,0x1F08,0x300},{0x80001F0B,0x1F09,0x300},
    {0x80001F0C,0x1F08,0x301},{0x80001F0D,0x1F09,0x301},{0x80001F0E,0x1F08,0x342},{0x80001F0F,0x1F09,0x342},{0x80001F10,0x3B5,0x313},{0x80001F11,0x3B5,0x314},
    {0x80001F12,0x1F10,0x300},{0x80001F13,0x1F11,0x300},{0x80001F14,0x1F10,0x301},{0x80001F15,0x1F11,0x301},{0x80001F18,0x395,0x313},{0x80001F19,0x395,0x314},
    {0x80001F1A,0x1F18,0x300},{0x80001F1B,0x1F19,0x300},{0x80001F1C,0x1F18,0x301},{0x80001F1D,0x1F19,0x301},{0x80001F20,0x3B7,0x313},{0x80001F21,0x3B7,0x314},
    {0x80001F22,0x1F20,0x300},{0x80001F23,0x1F21,0x300},{0x80001F24,0x1F20,0x301},{0x80001F25,0x1F21,0x301},{0x80001F26,0x1F20,0x342},{0x80001F27,0x1F21,0x342},
    {0x80001F28,0x397,0x313},{0x80001F29,0x397,0x314},{0x80001F2A,0x1F28,0x300},{0x80001F2B,0x1F29,0x300},{0x80001F2C,0x1F28,0x301},{0x80001F2D,0x1F29,0x301},
    {0x80001F2E,0x1F28,0x342},{0x80001F2F,0x1F29,0x342},{0x80001F30,0x3B9,0x313},{0x80001F31,0x3B9,0x314},{0x80001F32,0x1F30,0x300},{0x80001F33,0x1F31,0x300},
    {0x80001F34,0x1F30,0x301},{0x80001F35,0x1F31,0x301},{0x80001F36,0x1F30,0x342},{0x80001F37,0x1F31,0x342},{0x80001F38,0x399,0x313},{0x80001F39,0x399,0x314},
    {0x80001F3A,0x1F38,0x300},{0x80001F3B,0x1F39,0x300},{0x80001F3C,0x1F38,0x301},{0x80001F3D,0x1F39,0x301},{0x80001F3E,0x1F38,0x342},{0x80001F3F,0x1F39,0x342},
    {0x80001F40,0x3BF,0x313},{0x80001F41,0x3BF,0x314},{0x80001F42,0x1F40,0x300},{0x80001F43,0x1F41,0x300},{0x80001F44,0x1F40,0x301},{0x80001F45,0x1F41,0x301},
    {0x80001F48,0x39F,0x313},{0x80001F49,0x39F,0x314},{0x80001F4A,0x1F48,0x300},{0x80001F4B,0x1F49,0x300},{0x80001F4C,0x1F48,0x301},{0x80001F4D,0x1F49,0x301},
    {0x80001F50,0x3C5,0x313},{0x80001F51,0x3C5,0x314},{0x80001F52,0x1F50,0x300},{0x80001F53,0x1F51,0x300},{0x80001F54,0x1F50,0x301},{0x80001F55,0x1F51,0x301},
    {0x80001F56,0x1F50,0x342},{0x80001F57,0x1F51,0x342},{0x80001F59,0x3A5,0x314},{0x80001F5B,0x1F59,0x300},{0x80001F5D,0x1F59,0x301},{0x80001F5F,0x1F59,0x342},
    {0x80001F60,0x3C9,0x313},{0x80001F61,0x3C9,0x314},{0x80001F62,0x1F60,0x300},{0x80001F63,0x1F61,0x300},{0x80001F64,0x1F60,0x301},{0x80001F65,0x1F61,0x301},
    {0x80001F66,0x1F60,0x342},{0x80001F67,0x1F61,0x342},{0x80001F68,0x3A9,0x313},{0x80001F69,0x3A9,0x314},{0x80001F6A,0x1F68,0x300},{0x80001F6B,0x1F69,0x300},
    {0x80001F6C,0x1F68,0x301},{0x80001F6D,0x1F69,0x301},{0x80001F6E,0x1F68,0x342},{0x80001F6F,0x1F69,0x342},{0x80001F70,0x3B1,0x300},{0x1F71,0x3AC,0x0},
    {0x80001F72,0x3B5,0x300},{0x1F73,0x3AD,0x0},{0x80001F74,0x3B7,0x300},{0x1F75,0x3AE,0x0},{0x80001F76,0x3B9,0x300},{0x1F77,0x3AF,0x0},
    {0x80001F78,0x3BF,0x300},{0x1F79,0x3CC,0x0},{0x80001F7A,0x3C5,0x300},{0x1F7B,0x3CD,0x0},{0x80001F7C,0x3C9,0x300},{0x1F7D,0x3CE,0x0},
    {0x80001F80,0x1F00,0x345},{0x80001F81,0x1F01,0x345},{0x80001F82,0x1F02,0x345},{0x80001F83,0x1F03,0x345},{0x80001F84,0x1F04,0x345},{0x80001F85,0x1F05,0x345},
    {0x80001F86,0x1F06,0x345},{0x80001F87,0x1F07,0x345},{0x80001F88,0x1F08,0x345},{0x80001F89,0x1F09,0x345},{0x80001F8A,0x1F0A,0x345},{0x80001F8B,0x1F0B,0x345},
    {0x80001F8C,0x1F0C,0x345},{0x80001F8D,0x1F0D,0x345},{0x80001F8E,0x1F0E,0x345},{0x80001F8F,0x1F0F,0x345},{0x80001F90,0x1F20,0x345},{0x80001F91,0x1F21,0x345},
    {0x80001F92,0x1F22,0x345},{0x80001F93,0x1F23,0x345},{0x80001F94,0x1F24,0x345},{0x80001F95,0x1F25,0x345},{0x80001F96,0x1F26,0x345},{0x80001F97,0x1F27,0x345},
    {0x80001F98,0x1F28,0x345},{0x80001F99,0x1F29,0x345},{0x80001F9A,0x1F2A,0x345},{0x80001F9B,0x1F2B,0x345},{0x80001F9C,0x1F2C,0x345},{0x80001F9D,0x1F2D,0x345},
    {0x80001F9E,0x1F2E,0x345},{0x80001F9F,0x1F2F,0x345},{0x80001FA0,0x1F60,0x345},{0x80001FA1,0x1F61,0x345},{0x80001FA2,0x1F62,0x345},{0x80001FA3,0x1F63,0x345},
    {0x80001FA4,0x1F64,0x345},{0x80001FA5,0x1F65,0x345},{0x80001FA6,0x1F66,0x345},{0x80001FA7,0x1F67,0x345},{0x80001FA8,0x1F68,0x345},{0x80001FA9,0x1F69,0x345},
    {0x80001FAA,0x1F6A,0x345},{0x80001FAB,0x1F6B,0x345},{0x80001FAC,0x1F6C,0x345},{0x80001FAD,0x1F6D,0x345},{0x80001FAE,0x1F6E,0x345},{0x80001FAF,0x1F6F,0x345},
    {0x80001FB0,0x3B1,0x306},{0x80001FB1,0x3B1,0x304},{0x80001FB2,0x1F70,0x345},{0x80001FB3,0x3B1,0x345},{0x80001FB4,0x3AC,0x345},{0x80001FB6,0x3B1,0x342},
    {0x80001FB7,0x1FB6,0x345},{0x80001FB8,0x391,0x306},{0x80001FB9,0x391,0x304},{0x80001FBA,0x391,0x300},{0x1FBB,0x386,0x0},{0x80001FBC,0x391,0x345},
    {0x1FBE,0x3B9,0x0},{0x80001FC1,0xA8,0x342},{0x80001FC2,0x1F74,0x345},{0x80001FC3,0x3B7,0x345},{0x80001FC4,0x3AE,0x345},{0x80001FC6,0x3B7,0x342},
    {0x80001FC7,0x1FC6,0x345},{0x80001FC8,0x395,0x300},{0x1FC9,0x388,0x0},{0x80001FCA,0x397,0x300},{0x1FCB,0x389,0x0},{0x80001FCC,0x397,0x345},
    {0x80001FCD,0x1FBF,0x300},{0x80001FCE,0x1FBF,0x301},{0x80001FCF,0x1FBF,0x342},{0x80001FD0,0x3B9,0x306},{0x80001FD1,0x3B9,0x304},{0x80001FD2,0x3CA,0x300},
    {0x1FD3,0x390,0x0},{0x80001FD6,0x3B9,0x342},{0x80001FD7,0x3CA,0x342},{0x80001FD8,0x399,0x306},{0x80001FD9,0x399,0x304},{0x80001FDA,0x399,0x300},
    {0x1FDB,0x38A,0x0},{0x80001FDD,0x1FFE,0x300},{0x80001FDE,0x1FFE,0x301},{0x80001FDF,0x1FFE,0x342},{0x80001FE0,0x3C5,0x306},{0x80001FE1,0x3C5,0x304},
    {0x80001FE2,0x3CB,0x300},{0x1FE3,0x3B0,0x0},{0x80001FE4,0x3C1,0x313},{0x80001FE5,0x3C1,0x314},{0x80001FE6,0x3C5,0x342},{0x80001FE7,0x3CB,0x342},
    {0x80001FE8,0x3A5,0x306},{0x80001FE9,0x3A5,0x304},{0x80001FEA,0x3A5,0x300},{0x1FEB,0x38E,0x0},{0x80001FEC,0x3A1,0x314},{0x80001FED,0xA8,0x300},
    {0x1FEE,0x385,0x0},{0x1FEF,0x60,0x0},{0x80001FF2,0x1F7C,0x345},{0x80001FF3,0x3C9,0x345},{0x80001FF4,0x3CE,0x345},{0x80001FF6,0x3C9,0x342},
    {0x80001FF7,0x1FF6,0x345},{0x80001FF8,0x39F,0x300},{0x1FF9,0x38C,0x0},{0x80001FFA,0x3A9,0x300},{0x1FFB,0x38F,0x0},{0x80001FFC,0x3A9,0x345},
    {0x1FFD,0xB4,0x0},{0x2000,0x2002,0x0},{0x2001,0x2003,0x0},{0x2126,0x3A9,0x0},{0x212A,0x4B,0x0},{0x212B,0xC5,0x0},
    {0x8000219A,0x2190,0x338},{0x8000219B,0x2192,0x338},{0x800021AE,0x2194,0x338},{0x800021CD,0x21D0,0x338},{0x800021CE,0x21D4,0x338},{0x800021CF,0x21D2,0x338},
    {0x80002204,0x2203,0x338},{0x80002209,0x2208,0x338},{0x8000220C,0x220B,0x338},{0x80002224,0x2223,0x338},{0x80002226,0x2225,0x338},{0x80002241,0x223C,0x338},
    {0x80002244,0x2243,0x338},{0x80002247,0x2245,0x338},{0x80002249,0x2248,0x338},{0x80002260,0x3D,0x338},{0x80002262,0x2261,0x338},{0x8000226D,0x224D,0x338},
    {0x8000226E,0x3C,0x338},{0x8000226F,0x3E,0x338},{0x80002270,0x2264,0x338},{0x80002271,0x2265,0x338},{0x80002274,0x2272,0x338},{0x80002275,0x2273,0x338},
    {0x80002278,0x2276,0x338},{0x80002279,0x2277,0x338},{0x80002280,0x227A,0x338},{0x80002281,0x227B,0x338},{0x80002284,0x2282,0x338},{0x80002285,0x2283,0x338},
    {0x80002288,0x2286,0x338},{0x80002289,0x2287,0x338},{0x800022AC,0x22A2,0x338},{0x800022AD,0x22A8,0x338},{0x800022AE,0x22A9,0x338},{0x800022AF,0x22AB,0x338},
    {0x800022E0,0x227C,0x338},{0x800022E1,0x227D,0x338},{0x800022E2,0x2291,0x338},{0x800022E3,0x2292,0x338},{0x800022EA,0x22B2,0x338},{0x800022EB,0x22B3,0x338},
    {0x800022EC,0x22B4,0x338},{0x800022ED,0x22B5,0x338},{0x2329,0x3008,0x0},{0x232A,0x3009,0x0},{0x2ADC,0x2ADD,0x338},{0x8000304C,0x304B,0x3099},
    {0x8000304E,0x304D,0x3099},{0x80003050,0x304F,0x3099},{0x80003052,0x3051,0x3099},{0x80003054,0x3053,0x3099},{0x80003056,0x3055,0x3099},{0x80003058,0x3057,0x3099},
    {0x8000305A,0x3059,0x3099},{0x8000305C,0x305B,0x3099},{0x8000305E,0x305D,0x3099},{0x80003060,0x305F,0x3099},{0x80003062,0x3061,0x3099},{0x80003065,0x3064,0x3099},
    {0x80003067,0x3066,0x3099},{0x80003069,0x3068,0x3099},{0x80003070,0x306F,0x3099},{0x80003071,0x306F,0x309A},{0x80003073,0x3072,0x3099},{0x80003074,0x3072,0x309A},
    {0x80003076,0x3075,0x3099},{0x80003077,0x3075,0x309A},{0x80003079,0x3078,0x3099},{0x8000307A,0x3078,0x309A},{0x8000307C,0x307B,0x3099},{0x8000307D,0x307B,0x309A},
    {0x80003094,0x3046,0x3099},{0x8000309E,0x309D,0x3099},{0x800030AC,0x30AB,0x3099},{0x800030AE,0x30AD,0x3099},{0x800030B0,0x30AF,0x3099},{0x800030B2,0x30B1,0x3099},
    {0x800030B4,0x30B3,0x3099},{0x800030B6,0x30B5,0x3099},{0x800030B8,0x30B7,0x3099},{0x800030BA,0x30B9,0x3099},{0x800030BC,0x30BB,0x3099},{0x800030BE,0x30BD,0x3099},
    {0x800030C0,0x30BF,0x3099},{0x800030C2,0x30C1,0x3099},{0x800030C5,0x30C4,0x3099},{0x800030C7,0x30C6,0x3099},{0x800030C9,0x30C8,0x3099},{0x800030D0,0x30CF,0x3099},
    {0x800030D1,0x30CF,0x309A},{0x800030D3,0x30D2,0x3099},{0x800030D4,0x30D2,0x309A},{0x800030D6,0x30D5,0x3099},{0x800030D7,0x30D5,0x309A},{0x800030D9,0x30D8,0x3099},
    {0x800030DA,0x30D8,0x309A},{0x800030DC,0x30DB,0x3099},{0x800030DD,0x30DB,0x309A},{0x800030F4,0x30A6,0x3099},{0x800030F7,0x30EF,0x3099},{0x800030F8,0x30F0,0x3099},
    {0x800030F9,0x30F1,0x3099},{0x800030FA,0x30F2,0x3099},{0x800030FE,0x30FD,0x3099},{0xF900,0x8C48,0x0},{0xF901,0x66F4,0x0},{0xF902,0x8ECA,0x0},
    {0xF903,0x8CC8,0x0},{0xF904,0x6ED1,0x0},{0xF905,0x4E32,0x0},{0xF906,0x53E5,0x0},{0xF907,0x9F9C,0x0},{0xF908,0x9F9C,0x0},
    {0xF909,0x5951,0x0},{0xF90A,0x91D1,0x0},{0xF90B,0x5587,0x0},{0xF90C,0x5948,0x0},{0xF90D,0x61F6,0x0},{0xF90E,0x7669,0x0},
    {0xF90F,0x7F85,0x0},{0xF910,0x863F,0x0},{0xF911,0x87BA,0x0},{0xF912,0x88F8,0x0},{0xF913,0x908F,0x0},{0xF914,0x6A02,0x0},
    {0xF915,0x6D1B,0x0},{0xF916,0x70D9,0x0},{0xF917,0x73DE,0x0},{0xF918,0x843D,0x0},{0xF919,0x916A,0x0},{0xF91A,0x99F1,0x0},
    {0xF91B,0x4E82,0x0},{0xF91C,0x5375,0x0},{0xF91D,0x6B04,0x0},{0xF91E,0x721B,0x0},{0xF91F,0x862D,0x0},{0xF920,0x9E1E,0x0},
    {0xF921,0x5D50,0x0},{0xF922,0x6FEB,0x0},{0xF923,0x85CD,0x0},{0xF924,0x8964,0x0},{0xF925,0x62C9,0x0},{0xF926,0x81D8,0x0},
    {0xF927,0x881F,0x0},{0xF928,0x5ECA,0x0},{0xF929,0x6717,0x0},{0xF92A,0x6D6A,0x0},{0xF92B,0x72FC,0x0},{0xF92C,0x90CE,0x0},
    {0xF92D,0x4F86,0x0},{0xF92E,0x51B7,0x0},{0xF92F,0x52DE,0x0},{0xF930,0x64C4,0x0},{0xF931,0x6AD3,0x0},{0xF932,0x7210,0x0},
    {0xF933,0x76E7,0x0},{0xF934,0x8001,0x0},{0xF935,0x8606,0x0},{0xF936,0x865C,0x0},{0xF937,0x8DEF,0x0},{0xF938,0x9732,0x0},
    {0xF939,0x9B6F,0x0},{0xF93A,0x9DFA,0x0},{0xF93B,0x788C,0x0},{0xF93C,0x797F,0x0},{0xF93D,0x7DA0,0x0},{0xF93E,0x83C9,0x0},
    {0xF93F,0x9304,0x0},{0xF940,0x9E7F,0x0},{0xF941,0x8AD6,0x0},{0xF942,0x58DF,0x0},{0xF943,0x5F04,0x0},{0xF944,0x7C60,0x0},
    {0xF945,0x807E,0x0},{0xF946,0x7262,0x0},{0xF947,0x78CA,0x0},{0xF948,0x8CC2,0x0},{0xF949,0x96F7,0x0},{0xF94A,0x58D8,0x0},
    {0xF94B,0x5C62,0x0},{0xF94C,0x6A13,0x0},{0xF94D,0x6DDA,0x0},{0xF94E,0x6F0F,0x0},{0xF94F,0x7D2F,0x0},{0xF950,0x7E37,0x0},
    {0xF951,0x964B,0x0},{0xF952,0x52D2,0x0},{0xF953,0x808B,0x0},{0xF954,0x51DC,0x0},{0xF955,0x51CC,0x0},{0xF956,0x7A1C,0x0},
    {0xF957,0x7DBE,0x0},{0xF958,0x83F1,0x0},{0xF959,0x9675,0x0},{0xF95A,0x8B80,0x0},{0xF95B,0x62CF,0x0},{0xF95C,0x6A02,0x0},
    {0xF95D,0x8AFE,0x0},{0xF95E,0x4E39,0x0},{0xF95F,0x5BE7,0x0},{0xF960,0x6012,0x0},{0xF961,0x7387,0x0},{0xF962,0x7570,0x0},
    {0xF963,0x5317,0x0},{0xF964,0x78FB,0x0},{0xF965,0x4FBF,0x0},{0xF966,0x5FA9,0x0},{0xF967,0x4E0D,0x0},{0xF968,0x6CCC,0x0},
    {0xF969,0x6578,0x0},{0xF96A,0x7D22,0x0},{0xF96B,0x53C3,0x0},{0xF96C,0x585E,0x0},{0xF96D,0x7701,0x0},{0xF96E,0x8449,0x0},
    {0xF96F,0x8AAA,0x0},{0xF970,0x6BBA,0x0},{0xF971,0x8FB0,0x0},{0xF972,0x6C88,0x0},{0xF973,0x62FE,0x0},{0xF974,0x82E5,0x0},
    {0xF975,0x63A0,0x0},{0xF976,0x7565,0x0},{0xF977,0x4EAE,0x0},{0xF978,0x5169,0x0},{0xF979,0x51C9,0x0},{0xF97A,0x6881,0x0},
    {0xF97B,0x7CE7,0x0},{0xF97C,0x826F,0x0},{0xF97D,0x8AD2,0x0},{0xF97E,0x91CF,0x0},{0xF97F,0x52F5,0x0},{0xF980,0x5442,0x0},
    {0xF981,0x5973,0x0},{0xF982,0x5EEC,0x0},{0xF983,0x65C5,0x0},{0xF984,0x6FFE,0x0},{0xF985,0x792A,0x0},{0xF986,0x95AD,0x0},
    {0xF987,0x9A6A,0x0},{0xF988,0x9E97,0x0},{0xF989,0x9ECE,0x0},{0xF98A,0x529B,0x0},{0xF98B,0x66C6,0x0},{0xF98C,0x6B77,0x0},
    {0xF98D,0x8F62,0x0},{0xF98E,0x5E74,0x0},{0xF98F,0x6190,0x0},{0xF990,0x6200,0x0},{0xF991,0x649A,0x0},{0xF992,0x6F23,0x0},
    {0xF993,0x7149,0x0},{0xF994,0x7489,0x0},{0xF995,0x79CA,0x0},{0xF996,0x7DF4,0x0},{0xF997,0x806F,0x0},{0xF998,0x8F26,0x0},
    {0xF999,0x84EE,0x0},{0xF99A,0x9023,0x0},{0xF99B,0x934A,0x0},{0xF99C,0x5217,0x0},{0xF99D,0x52A3,0x0},{0xF99E,0x54BD,0x0},
    {0xF99F,0x70C8,0x0},{0xF9A0,0x88C2,0x0},{0xF9A1,0x8AAA,0x0},{0xF9A2,0x5EC9,0x0},{0xF9A3,0x5FF5,0x0},{0xF9A4,0x637B,0x0},
    {0xF9A5,0x6BAE,0x0},{0xF9A6,0x7C3E,0x0},{0xF9A7,0x7375,0x0},{0xF9A8,0x4EE4,0x0},{0xF9A9,0x56F9,0x0},{0xF9AA,0x5BE7,0x0},
    {0xF9AB,0x5DBA,0x0},{0xF9AC,0x601C,0x0},{0xF9AD,0x73B2,0x0},{0xF9AE,0x7469,0x0},{0xF9AF,0x7F9A,0x0},{0xF9B0,0x8046,0x0},
    {0xF9B1,0x9234,0x0},{0xF9B2,0x96F6,0x0},{0xF9B3,0x9748,0x0},{0xF9B4,0x9818,0x0},{0xF9B5,0x4F8B,0x0},{0xF9B6,0x79AE,0x0},
    {0xF9B7,0x91B4,0x0},{0xF9B8,0x96B8,0x0},{0xF9B9,0x60E1,0x0},{0xF9BA,0x4E86,0x0},{0xF9BB,0x50DA,0x0},{0xF9BC,0x5BEE,0x0},
    {0xF9BD,0x5C3F,0x0},{0xF9BE,0x6599,0x0},{0xF9BF,0x6A02,0x0},{0xF9C0,0x71CE,0x0},{0xF9C1,0x7642,0x0},{0xF9C2,0x84FC,0x0},
    {0xF9C3,0x907C,0x0},{0xF9C4,0x9F8D,0x0},{0xF9C5,0x6688,0x0},{0xF9C6,0x962E,0x0},{0xF9C7,0x5289,0x0},{0xF9C8,0x677B,0x0},
    {0xF9C9,0x67F3,0x0},{0xF9CA,0x6D41,0x0},{0xF9CB,0x6E9C,0x0},{0xF9CC,0x7409,0x0},{0xF9CD,0x7559,0x0},{0xF9CE,0x786B,0x0},
    {0xF9CF,0x7D10,0x0},{0xF9D0,0x985E,0x0},{0xF9D1,0x516D,0x0},{0xF9D2,0x622E,0x0},{0xF9D3,0x9678,0x0},{0xF9D4,0x502B,0x0},
    {0xF9D5,0x5D19,0x0},{0xF9D6,0x6DEA,0x0},{0xF9D7,0x8F2A,0x0},{0xF9D8,0x5F8B,0x0},{0xF9D9,0x6144,0x0},{0xF9DA,0x6817,0x0},
    {0xF9DB,0x7387,0x0},{0xF9DC,0x9686,0x0},{0xF9DD,0x5229,0x0},{0xF9DE,0x540F,0x0},{0xF9DF,0x5C65,0x0},{0xF9E0,0x6613,0x0},
    {0xF9E1,0x674E,0x0},{0xF9E2,0x68A8,0x0},{0xF9E3,0x6CE5,0x0},{0xF9E4,0x7406,0x0},{0xF9E5,0x75E2,0x0},{0xF9E6,0x7F79,0x0},
    {0xF9E7,0x88CF,0x0},{0xF9E8,0x88E1,0x0},{0xF9E9,0x91CC,0x0},{0xF9EA,0x96E2,0x0},{0xF9EB,0x533F,0x0},{0xF9EC,0x6EBA,0x0},
    {0xF9ED,0x541D,0x0},{0xF9EE,0x71D0,0x0},{0xF9EF,0x7498,0x0},{0xF9F0,0x85FA,0x0},{0xF9F1,0x96A3,0x0},{0xF9F2,0x9C57,0x0},
    {0xF9F3,0x9E9F,0x0},{0xF9F4,0x6797,0x0},{0xF9F5,0x6DCB,0x0},{0xF9F6,0x81E8,0x0},{0xF9F7,0x7ACB,0x0},{0xF9F8,0x7B20,0x0},
    {0xF9F9,0x7C92,0x0},{0xF9FA,0x72C0,0x0},{0xF9FB,0x7099,0x0},{0xF9FC,0x8B58,0x0},{0xF9FD,0x4EC0,0x0},{0xF9FE,0x8336,0x0},
    {0xF9FF,0x523A,0x0},{0xFA00,0x5207,0x0},{0xFA01,0x5EA6,0x0},{0xFA02,0x62D3,0x0},{0xFA03,0x7CD6,0x0},{0xFA04,0x5B85,0x0},
    {0xFA05,0x6D1E,0x0},{0xFA06,0x66B4,0x0},{0xFA07,0x8F3B,0x0},{0xFA08,0x884C,0x0},{0xFA09,0x964D,0x0},{0xFA0A,0x898B,0x0},
    {0xFA0B,0x5ED3,0x0},{0xFA0C,0x5140,0x0},{0xFA0D,0x55C0,0x0},{0xFA10,0x585A,0x0},{0xFA12,0x6674,0x0},{0xFA15,0x51DE,0x0},
    {0xFA16,0x732A,0x0},{0xFA17,0x76CA,0x0},{0xFA18,0x793C,0x0},{0xFA19,0x795E,0x0},{0xFA1A,0x7965,0x0},{0xFA1B,0x798F,0x0},
    {0xFA1C,0x9756,0x0},{0xFA1D,0x7CBE,0x0},{0xFA1E,0x7FBD,0x0},{0xFA20,0x8612,0x0},{0xFA22,0x8AF8,0x0},{0xFA25,0x9038,0x0},
    {0xFA26,0x90FD,0x0},{0xFA2A,0x98EF,0x0},{0xFA2B,0x98FC,0x0},{0xFA2C,0x9928,0x0},{0xFA2D,0x9DB4,0x0},{0xFA2E,0x90DE,0x0},
    {0xFA2F,0x96B7,0x0},{0xFA30,0x4FAE,0x0},{0xFA31,0x50E7,0x0},{0xFA32,0x514D,0x0},{0xFA33,0x52C9,0x0},{0xFA34,0x52E4,0x0},
    {0xFA35,0x5351,0x0},{0xFA36,0x559D,0x0},{0xFA37,0x5606,0x0},{0xFA38,0x5668,0x0},{0xFA39,0x5840,0x0},{0xFA3A,0x58A8,0x0},
    {0xFA3B,0x5C64,0x0},{0xFA3C,0x5C6E,0x0},{0xFA3D,0x6094,0x0},{0xFA3E,0x6168,0x0},{0xFA3F,0x618E,0x0},{0xFA40,0x61F2,0x0},
    {0xFA41,0x654F,0x0},{0xFA42,0x65E2,0x0},{0xFA43,0x6691,0x0},{0xFA44,0x6885,0x0},{0xFA45,0x6D77,0x0},{0xFA46,0x6E1A,0x0},
    {0xFA47,0x6F22,0x0},{0xFA48,0x716E,0x0},{0xFA49,0x722B,0x0},{0xFA4A,0x7422,0x0},{0xFA4B,0x7891,0x0},{0xFA4C,0x793E,0x0},
    {0xFA4D,0x7949,0x0},{0xFA4E,0x7948,0x0},{0xFA4F,0x7950,0x0},{0xFA50,0x7956,0x0},{0xFA51,0x795D,0x0},{0xFA52,0x798D,0x0},
    {0xFA53,0x798E,0x0},{0xFA54,0x7A40,0x0},{0xFA55,0x7A81,0x0},{0xFA56,0x7BC0,0x0},{0xFA57,0x7DF4,0x0},{0xFA58,0x7E09,0x0},
    {0xFA59,0x7E41,0x0},{0xFA5A,0x7F72,0x0},{0xFA5B,0x8005,0x0},{0xFA5C,0x81ED,0x0},{0xFA5D,0x8279,0x0},{0xFA5E,0x8279,0x0},
    {0xFA5F,0x8457,0x0},{0xFA60,0x8910,0x0},{0xFA61,0x8996,0x0},{0xFA62,0x8B01,0x0},{0xFA63,0x8B39,0x0},{0xFA64,0x8CD3,0x0},
    {0xFA65,0x8D08,0x0},{0xFA66,0x8FB6,0x0},{0xFA67,0x9038,0x0},{0xFA68,0x96E3,0x0},{0xFA69,0x97FF,0x0},{0xFA6A,0x983B,0x0},
    {0xFA6B,0x6075,0x0},{0xFA6C,0x242EE,0x0},{0xFA6D,0x8218,0x0},{0xFA70,0x4E26,0x0},{0xFA71,0x51B5,0x0},{0xFA72,0x5168,0x0},
    {0xFA73,0x4F80,0x0},{0xFA74,0x5145,0x0},{0xFA75,0x5180,0x0},{0xFA76,0x52C7,0x0},{0xFA77,0x52FA,0x0},{0xFA78,0x559D,0x0},
    {0xFA79,0x5555,0x0},{0xFA7A,0x5599,0x0},{0xFA7B,0x55E2,0x0},{0xFA7C,0x585A,0x0},{0xFA7D,0x58B3,0x0},{0xFA7E,0x5944,0x0},
    {0xFA7F,0x5954,0x0},{0xFA80,0x5A62,0x0},{0xFA81,0x5B28,0x0},{0xFA82,0x5ED2,0x0},{0xFA83,0x5ED9,0x0},{0xFA84,0x5F69,0x0},
    {0xFA85,0x5FAD,0x0},{0xFA86,0x60D8,0x0},{0xFA87,0x614E,0x0},{0xFA88,0x6108,0x0},{0xFA89,0x618E,0x0},{0xFA8A,0x6160,0x0},
    {0xFA8B,0x61F2,0x0},{0xFA8C,0x6234,0x0},{0xFA8D,0x63C4,0x0},{0xFA8E,0x641C,0x0},{0xFA8F,0x6452,0x0},{0xFA90,0x6556,0x0},
    {0xFA91,0x6674,0x0},{0xFA92,0x6717,0x0},{0xFA93,0x671B,0x0},{0xFA94,0x6756,0x0},{0xFA95,0x6B79,0x0},{0xFA96,0x6BBA,0x0},
    {0xFA97,0x6D41,0x0},{0xFA98,0x6EDB,0x0},{0xFA99,0x6ECB,0x0},{0xFA9A,0x6F22,0x0},{0xFA9B,0x701E,0x0},{0xFA9C,0x716E,0x0},
    {0xFA9D,0x77A7,0x0},{0xFA9E,0x7235,0x0},{0xFA9F,0x72AF,0x0},{0xFAA0,0x732A,0x0},{0xFAA1,0x7471,0x0},{0xFAA2,0x7506,0x0},
    {0xFAA3,0x753B,0x0},{0xFAA4,0x761D,0x0},{0xFAA5,0x761F,0x0},{0xFAA6,0x76CA,0x0},{0xFAA7,0x76DB,0x0},{0xFAA8,0x76F4,0x0},
    {0xFAA9,0x774A,0x0},{0xFAAA,0x7740,0x0},{0xFAAB,0x78CC,0x0},{0xFAAC,0x7AB1,0x0},{0xFAAD,0x7BC0,0x0},{0xFAAE,0x7C7B,0x0},
    {0xFAAF,0x7D5B,0x0},{0xFAB0,0x7DF4,0x0},{0xFAB1,0x7F3E,0x0},{0xFAB2,0x8005,0x0},{0xFAB3,0x8352,0x0},{0xFAB4,0x83EF,0x0},
    {0xFAB5,0x8779,0x0},{0xFAB6,0x8941,0x0},{0xFAB7,0x8986,0x0},{0xFAB8,0x8996,0x0},{0xFAB9,0x8ABF,0x0},{0xFABA,0x8AF8,0x0},
    {0xFABB,0x8ACB,0x0},{0xFABC,0x8B01,0x0},{0xFABD,0x8AFE,0x0},{0xFABE,0x8AED,0x0},{0xFABF,0x8B39,0x0},{0xFAC0,0x8B8A,0x0},
    {0xFAC1,0x8D08,0x0},{0xFAC2,0x8F38,0x0},{0xFAC3,0x9072,0x0},{0xFAC4,0x9199,0x0},{0xFAC5,0x9276,0x0},{0xFAC6,0x967C,0x0},
    {0xFAC7,0x96E3,0x0},{0xFAC8,0x9756,0x0},{0xFAC9,0x97DB,0x0},{0xFACA,0x97FF,0x0},{0xFACB,0x980B,0x0},{0xFACC,0x983B,0x0},
    {0xFACD,0x9B12,0x0},{0xFACE,0x9F9C,0x0},{0xFACF,0x2284A,0x0},{0xFAD0,0x22844,0x0},{0xFAD1,0x233D5,0x0},{0xFAD2,0x3B9D,0x0},
    {0xFAD3,0x4018,0x0},{0xFAD4,0x4039,0x0},{0xFAD5,0x25249,0x0},{0xFAD6,0x25CD0,0x0},{0xFAD7,0x27ED3,0x0},{0xFAD8,0x9F43,0x0},
    {0xFAD9,0x9F8E,0x0},{0xFB1D,0x5D9,0x5B4},{0xFB1F,0x5F2,0x5B7},{0xFB2A,0x5E9,0x5C1},{0xFB2B,0x5E9,0x5C2},{0xFB2C,0xFB49,0x5C1},
    {0xFB2D,0xFB49,0x5C2},{0xFB2E,0x5D0,0x5B7},{0xFB2F,0x5D0,0x5B8},{0xFB30,0x5D0,0x5BC},{0xFB31,0x5D1,0x5BC},{0xFB32,0x5D2,0x5BC},
    {0xFB33,0x5D3,0x5BC},{0xFB34,0x5D4,0x5BC},{0xFB35,0x5D5,0x5BC},{0xFB36,0x5D6,0x5BC},{0xFB38,0x5D8,0x5BC},{0xFB39,0x5D9,0x5BC},
    {0xFB3A,0x5DA,0x5BC},{0xFB3B,0x5DB,0x5BC},{0xFB3C,0x5DC,0x5BC},{0xFB3E,0x5DE,0x5BC},{0xFB40,0x5E0,0x5BC},{0xFB41,0x5E1,0x5BC},
    {0xFB43,0x5E3,0x5BC},{0xFB44,0x5E4,0x5BC},{0xFB46,0x5E6,0x5BC},{0xFB47,0x5E7,0x5BC},{0xFB48,0x5E8,0x5BC},{0xFB49,0x5E9,0x5BC},
    {0xFB4A,0x5EA,0x5BC},{0xFB4B,0x5D5,0x5B9},{0xFB4C,0x5D1,0x5BF},{0xFB4D,0x5DB,0x5BF},{0xFB4E,0x5E4,0x5BF},{0x8001109A,0x11099,0x110BA},
    {0x8001109C,0x1109B,0x110BA},{0x800110AB,0x110A5,0x110BA},{0x8001112E,0x11131,0x11127},{0x8001112F,0x11132,0x11127},{0x8001134B,0x11347,0x1133E},{0x8001134C,0x11347,0x11357},
    {0x800114BB,0x114B9,0x114BA},{0x800114BC,0x114B9,0x114B0},{0x800114BE,0x114B9,0x114BD},{0x800115BA,0x115B8,0x115AF},{0x800115BB,0x115B9,0x115AF},{0x80011938,0x11935,0x11930},
    {0x1D15E,0x1D157,0x1D165},{0x1D15F,0x1D158,0x1D165},{0x1D160,0x1D15F,0x1D16E},{0x1D161,0x1D15F,0x1D16F},{0x1D162,0x1D15F,0x1D170},{0x1D163,0x1D15F,0x1D171},
    {0x1D164,0x1D15F,0x1D172},{0x1D1BB,0x1D1B9,0x1D165},{0x1D1BC,0x1D1BA,0x1D165},{0x1D1BD,0x1D1BB,0x1D16E},{0x1D1BE,0x1D1BC,0x1D16E},{0x1D1BF,0x1D1BB,0x1D16F},
    {0x1D1C0,0x1D1BC,0x1D16F},{0x2F800,0x4E3D,0x0},{0x2F801,0x4E38,0x0},{0x2F802,0x4E41,0x0},{0x2F803,0x20122,0x0},{0x2F804,0x4F60,0x0},
    {0x2F805,0x4FAE,0x0},{0x2F806,0x4FBB,0x0},{0x2F807,0x5002,0x0},{0x2F808,0x507A,0x0},{0x2F809,0x5099,0x0},{0x2F80A,0x50E7,0x0},
    {0x2F80B,0x50CF,0x0},{0x2F80C,0x349E,0x0},{0x2F80D,0x2063A,0x0},{0x2F80E,0x514D,0x0},{0x2F80F,0x5154,0x0},{0x2F810,0x5164,0x0},
    {0x2F811,0x5177,0x0},{0x2F812,0x2051C,0x0},{0x2F813,0x34B9,0x0},{0x2F814,0x5167,0x0},{0x2F815,0x518D,0x0},{0x2F816,0x2054B,0x0},
    {0x2F817,0x5197,0x0},{0x2F818,0x51A4,0x0},{0x2F819,0x4ECC,0x0},{0x2F81A,0x51AC,0x0},{0x2F81B,0x51B5,0x0},{0x2F81C,0x291DF,0x0},
    {0x2F81D,0x51F5,0x0},{0x2F81E,0x5203,0x0},{0x2F81F,0x34DF,0x0},{0x2F820,0x523B,0x0},{0x2F821,0x5246,0x0},{0x2F822,0x5272,0x0},
    {0x2F823,0x5277,0x0},{0x2F824,0x3515,0x0},{0x2F825,0x52C7,0x0},{0x2F826,0x52C9,0x0},{0x2F827,0x52E4,0x0},{0x2F828,0x52FA,0x0},
    {0x2F829,0x5305,0x0},{0x2F82A,0x5306,0x0},{0x2F82B,0x5317,0x0},{0x2F82C,0x5349,0x0},{0x2F82D,0x5351,0x0},{0x2F82E,0x535A,0x0},
    {0x2F82F,0x5373,0x0},{0x2F830,0x537D,0x0},{0x2F831,0x537F,0x0},{0x2F832,0x537F,0x0},{0x2F833,0x537F,0x0},{0x2F834,0x20A2C,0x0},
    {0x2F835,0x7070,0x0},{0x2F836,0x53CA,0x0},{0x2F837,0x53DF,0x0},{0x2F838,0x20B63,0x0},{0x2F839,0x53EB,0x0},{0x2F83A,0x53F1,0x0},
    {0x2F83B,0x5406,0x0},{0x2F83C,0x549E,0x0},{0x2F83D,0x5438,0x0},{0x2F83E,0x5448,0x0},{0x2F83F,0x5468,0x0},{0x2F840,0x54A2,0x0},
    {0x2F841,0x54F6,0x0},{0x2F842,0x5510,0x0},{0x2F843,0x5553,0x0},{0x2F844,0x5563,0x0},{0x2F845,0x5584,0x0},{0x2F846,0x5584,0x0},
    {0x2F847,0x5599,0x0},{0x2F848,0x55AB,0x0},{0x2F849,0x55B3,0x0},{0x2F84A,0x55C2,0x0},{0x2F84B,0x5716,0x0},{0x2F84C,0x5606,0x0},
    {0x2F84D,0x5717,0x0},{0x2F84E,0x5651,0x0},{0x2F84F,0x5674,0x0},{0x2F850,0x5207,0x0},{0x2F851,0x58EE,0x0},{0x2F852,0x57CE,0x0},
    {0x2F853,0x57F4,0x0},{0x2F854,0x580D,0x0},{0x2F855,0x578B,0x0},{0x2F856,0x5832,0x0},{0x2F857,0x5831,0x0},{0x2F858,0x58AC,0x0},
    {0x2F859,0x214E4,0x0},{0x2F85A,0x58F2,0x0},{0x2F85B,0x58F7,0x0},{0x2F85C,0x5906,0x0},{0x2F85D,0x591A,0x0},{0x2F85E,0x5922,0x0},
    {0x2F85F,0x5962,0x0},{0x2F860,0x216A8,0x0},{0x2F861,0x216EA,0x0},{0x2F862,0x59EC,0x0},{0x2F863,0x5A1B,0x0},{0x2F864,0x5A27,0x0},
    {0x2F865,0x59D8,0x0},{0x2F866,0x5A66,0x0},{0x2F867,0x36EE,0x0},{0x2F868,0x36FC,0x0},{0x2F869,0x5B08,0x0},{0x2F86A,0x5B3E,0x0},
    {0x2F86B,0x5B3E,0x0},{0x2F86C,0x219C8,0x0},{0x2F86D,0x5BC3,0x0},{0x2F86E,0x5BD8,0x0},{0x2F86F,0x5BE7,0x0},{0x2F870,0x5BF3,0x0},
    {0x2F871,0x21B18,0x0},{0x2F872,0x5BFF,0x0},{0x2F873,0x5C06,0x0},{0x2F874,0x5F53,0x0},{0x2F875,0x5C22,0x0},{0x2F876,0x3781,0x0},
    {0x2F877,0x5C60,0x0},{0x2F878,0x5C6E,0x0},{0x2F879,0x5CC0,0x0},{0x2F87A,0x5C8D,0x0},{0x2F87B,0x21DE4,0x0},{0x2F87C,0x5D43,0x0},
    {0x2F87D,0x21DE6,0x0},{0x2F87E,0x5D6E,0x0},{0x2F87F,0x5D6B,0x0},{0x2F880,0x5D7C,0x0},{0x2F881,0x5DE1,0x0},{0x2F882,0x5DE2,0x0},
    {0x2F883,0x382F,0x0},{0x2F884,0x5DFD,0x0},{0x2F885,0x5E28,0x0},{0x2F886,0x5E3D,0x0},{0x2F887,0x5E69,0x0},{0x2F888,0x3862,0x0},
    {0x2F889,0x22183,0x0},{0x2F88A,0x387C,0x0},{0x2F88B,0x5EB0,0x0},{0x2F88C,0x5EB3,0x0},{0x2F88D,0x5EB6,0x0},{0x2F88E,0x5ECA,0x0},
    {0x2F88F,0x2A392,0x0},{0x2F890,0x5EFE,0x0},{0x2F891,0x22331,0x0},{0x2F892,0x22331,0x0},{0x2F893,0x8201,0x0},{0x2F894,0x5F22,0x0},
    {0x2F895,0x5F22,0x0},{0x2F896,0x38C7,0x0},{0x2F897,0x232B8,0x0},{0x2F898,0x261DA,0x0},{0x2F899,0x5F62,0x0},{0x2F89A,0x5F6B,0x0},
    {0x2F89B,0x38E3,0x0},{0x2F89C,0x5F9A,0x0},{0x2F89D,0x5FCD,0x0},{0x2F89E,0x5FD7,0x0},{0x2F89F,0x5FF9,0x0},{0x2F8A0,0x6081,0x0},
    {0x2F8A1,0x393A,0x0},{0x2F8A2,0x391C,0x0},{0x2F8A3,0x6094,0x0},{0x2F8A4,0x226D4,0x0},{0x2F8A5,0x60C7,0x0},{0x2F8A6,0x6148,0x0},
    {0x2F8A7,0x614C,0x0},{0x2F8A8,0x614E,0x0},{0x2F8A9,0x614C,0x0},{0x2F8AA,0x617A,0x0},{0x2F8AB,0x618E,0x0},{0x2F8AC,0x61B2,0x0},
    {0x2F8AD,0x61A4,0x0},{0x2F8AE,0x61AF,0x0},{0x2F8AF,0x61DE,0x0},{0x2F8B0,0x61F2,0x0},{0x2F8B1,0x61F6,0x0},{0x2F8B2,0x6210,0x0},
    {0x2F8B3,0x621B,0x0},{0x2F8B4,0x625D,0x0},{0x2F8B5,0x62B1,0x0},{0x2F8B6,0x62D4,0x0},{0x2F8B7,0x6350,0x0},{0x2F8B8,0x22B0C,0x0},
    {0x2F8B9,0x633D,0x0},{0x2F8BA,0x62FC,0x0},{0x2F8BB,0x6368,0x0},{0x2F8BC,0x6383,0x0},{0x2F8BD,0x63E4,0x0},{0x2F8BE,0x22BF1,0x0},
    {0x2F8BF,0x6422,0x0},{0x2F8C0,0x63C5,0x0},{0x2F8C1,0x63A9,0x0},{0x2F8C2,0x3A2E,0x0},{0x2F8C3,0x6469,0x0},{0x2F8C4,0x647E,0x0},
    {0x2F8C5,0x649D,0x0},{0x2F8C6,0x6477,0x0},{0x2F8C7,0x3A6C,0x0},{0x2F8C8,0x654F,0x0},{0x2F8C9,0x656C,0x0},{0x2F8CA,0x2300A,0x0},
    {0x2F8CB,0x65E3,0x0},{0x2F8CC,0x66F8,0x0},{0x2F8CD,0x6649,0x0},{0x2F8CE,0x3B19,0x0},{0x2F8CF,0x6691,0x0},{0x2F8D0,0x3B08,0x0},
    {0x2F8D1,0x3AE4,0x0},{0x2F8D2,0x5192,0x0},{0x2F8D3,0x5195,0x0},{0x2F8D4,0x6700,0x0},{0x2F8D5,0x669C,0x0},{0x2F8D6,0x80AD,0x0},
    {0x2F8D7,0x43D9,0x0},{0x2F8D8,0x6717,0x0},{0x2F8D9,0x671B,0x0},{0x2F8DA,0x6721,0x0},{0x2F8DB,0x675E,0x0},{0x2F8DC,0x6753,0x0},
    {0x2F8DD,0x233C3,0x0},{0x2F8DE,0x3B49,0x0},{0x2F8DF,0x67FA,0x0},{0x2F8E0,0x6785,0x0},{0x2F8E1,0x6852,0x0},{0x2F8E2,0x6885,0x0},
    {0x2F8E3,0x2346D,0x0},{0x2F8E4,0x688E,0x0},{0x2F8E5,0x681F,0x0},{0x2F8E6,0x6914,0x0},{0x2F8E7,0x3B9D,0x0},{0x2F8E8,0x6942,0x0},
    {0x2F8E9,0x69A3,0x0},{0x2F8EA,0x69EA,0x0},{0x2F8EB,0x6AA8,0x0},{0x2F8EC,0x236A3,0x0},{0x2F8ED,0x6ADB,0x0},{0x2F8EE,0x3C18,0x0},
    {0x2F8EF,0x6B21,0x0},{0x2F8F0,0x238A7,0x0},{0x2F8F1,0x6B54,0x0},{0x2F8F2,0x3C4E,0x0},{0x2F8F3,0x6B72,0x0},{0x2F8F4,0x6B9F,0x0},
    {0x2F8F5,0x6BBA,0x0},{0x2F8F6,0x6BBB,0x0},{0x2F8F7,0x23A8D,0x0},{0x2F8F8,0x21D0B,0x0},{0x2F8F9,0x23AFA,0x0},{0x2F8FA,0x6C4E,0x0},
    {0x2F8FB,0x23CBC,0x0},{0x2F8FC,0x6CBF,0x0},{0x2F8FD,0x6CCD,0x0},{0x2F8FE,0x6C67,0x0},{0x2F8FF,0x6D16,0x0},{0x2F900,0x6D3E,0x0},
    {0x2F901,0x6D77,0x0},{0x2F902,0x6D41,0x0},{0x2F903,0x6D69,0x0},{0x2F904,0x6D78,0x0},{0x2F905,0x6D85,0x0},{0x2F906,0x23D1E,0x0},
    {0x2F907,0x6D34,0x0},{0x2F908,0x6E2F,0x0},{0x2F909,0x6E6E,0x0},{0x2F90A,0x3D33,0x0},{0x2F90B,0x6ECB,0x0},{0x2F90C,0x6EC7,0x0},
    {0x2F90D,0x23ED1,0x0},{0x2F90E,0x6DF9,0x0},{0x2F90F,0x6F6E,0x0},{0x2F910,0x23F5E,0x0},{0x2F911,0x23F8E,0x0},{0x2F912,0x6FC6,0x0},
    {0x2F913,0x7039,0x0},{0x2F914,0x701E,0x0},{0x2F915,0x701B,0x0},{0x2F916,0x3D96,0x0},{0x2F917,0x704A,0x0},{0x2F918,0x707D,0x0},
    {0x2F919,0x7077,0x0},{0x2F91A,0x70AD,0x0},{0x2F91B,0x20525,0x0},{0x2F91C,0x7145,0x0},{0x2F91D,0x24263,0x0},{0x2F91E,0x719C,0x0},
    {0x2F91F,0x243AB,0x0},{0x2F920,0x7228,0x0},{0x2F921,0x7235,0x0},{0x2F922,0x7250,0x0},{0x2F923,0x24608,0x0},{0x2F924,0x7280,0x0},
    {0x2F925,0x7295,0x0},{0x2F926,0x24735,0x0},{0x2F927,0x24814,0x0},{0x2F928,0x737A,0x0},{0x2F929,0x738B,0x0},{0x2F92A,0x3EAC,0x0},
    {0x2F92B,0x73A5,0x0},{0x2F92C,0x3EB8,0x0},{0x2F92D,0x3EB8,0x0},{0x2F92E,0x7447,0x0},{0x2F92F,0x745C,0x0},{0x2F930,0x7471,0x0},
    {0x2F931,0x7485,0x0},{0x2F932,0x74CA,0x0},{0x2F933,0x3F1B,0x0},{0x2F934,0x7524,0x0},{0x2F935,0x24C36,0x0},{0x2F936,0x753E,0x0},
    {0x2F937,0x24C92,0x0},{0x2F938,0x7570,0x0},{0x2F939,0x2219F,0x0},{0x2F93A,0x7610,0x0},{0x2F93B,0x24FA1,0x0},{0x2F93C,0x24FB8,0x0},
    {0x2F93D,0x25044,0x0},{0x2F93E,0x3FFC,0x0},{0x2F93F,0x4008,0x0},{0x2F940,0x76F4,0x0},{0x2F941,0x250F3,0x0},{0x2F942,0x250F2,0x0},
    {0x2F943,0x25119,0x0},{0x2F944,0x25133,0x0},{0x2F945,0x771E,0x0},{0x2F946,0x771F,0x0},{0x2F947,0x771F,0x0},{0x2F948,0x774A,0x0},
    {0x2F949,0x4039,0x0},{0x2F94A,0x778B,0x0},{0x2F94B,0x4046,0x0},{0x2F94C,0x4096,0x0},{0x2F94D,0x2541D,0x0},{0x2F94E,0x784E,0x0},
    {0x2F94F,0x788C,0x0},{0x2F950,0x78CC,0x0},{0x2F951,0x40E3,0x0},{0x2F952,0x25626,0x0},{0x2F953,0x7956,0x0},{0x2F954,0x2569A,0x0},
    {0x2F955,0x256C5,0x0},{0x2F956,0x798F,0x0},{0x2F957,0x79EB,0x0},{0x2F958,0x412F,0x0},{0x2F959,0x7A40,0x0},{0x2F95A,0x7A4A,0x0},
    {0x2F95B,0x7A4F,0x0},{0x2F95C,0x2597C,0x0},{0x2F95D,0x25AA7,0x0},{0x2F95E,0x25AA7,0x0},{0x2F95F,0x7AEE,0x0},{0x2F960,0x4202,0x0},
    {0x2F961,0x25BAB,0x0},{0x2F962,0x7BC6,0x0},{0x2F963,0x7BC9,0x0},{0x2F964,0x4227,0x0},{0x2F965,0x25C80,0x0},{0x2F966,0x7CD2,0x0},
    {0x2F967,0x42A0,0x0},{0x2F968,0x7CE8,0x0},{0x2F969,0x7CE3,0x0},{0x2F96A,0x7D00,0x0},{0x2F96B,0x25F86,0x0},{0x2F96C,0x7D63,0x0},
    {0x2F96D,0x4301,0x0},{0x2F96E,0x7DC7,0x0},{0x2F96F,0x7E02,0x0},{0x2F970,0x7E45,0x0},{0x2F971,0x4334,0x0},{0x2F972,0x26228,0x0},
    {0x2F973,0x26247,0x0},{0x2F974,0x4359,0x0},{0x2F975,0x262D9,0x0},{0x2F976,0x7F7A,0x0},{0x2F977,0x2633E,0x0},{0x2F978,0x7F95,0x0},
    {0x2F979,0x7FFA,0x0},{0x2F97A,0x8005,0x0},{0x2F97B,0x264DA,0x0},{0x2F97C,0x26523,0x0},{0x2F97D,0x8060,0x0},{0x2F97E,0x265A8,0x0},
    {0x2F97F,0x8070,0x0},{0x2F980,0x2335F,0x0},{0x2F981,0x43D5,0x0},{0x2F982,0x80B2,0x0},{0x2F983,0x8103,0x0},{0x2F984,0x440B,0x0},
    {0x2F985,0x813E,0x0},{0x2F986,0x5AB5,0x0},{0x2F987,0x267A7,0x0},{0x2F988,0x267B5,0x0},{0x2F989,0x23393,0x0},{0x2F98A,0x2339C,0x0},
    {0x2F98B,0x8201,0x0},{0x2F98C,0x8204,0x0},{0x2F98D,0x8F9E,0x0},{0x2F98E,0x446B,0x0},{0x2F98F,0x8291,0x0},{0x2F990,0x828B,0x0},
    {0x2F991,0x829D,0x0},{0x2F992,0x52B3,0x0},{0x2F993,0x82B1,0x0},{0x2F994,0x82B3,0x0},{0x2F995,0x82BD,0x0},{0x2F996,0x82E6,0x0},
    {0x2F997,0x26B3C,0x0},{0x2F998,0x82E5,0x0},{0x2F999,0x831D,0x0},{0x2F99A,0x8363,0x0},{0x2F99B,0x83AD,0x0},{0x2F99C,0x8323,0x0},
    {0x2F99D,0x83BD,0x0},{0x2F99E,0x83E7,0x0},{0x2F99F,0x8457,0x0},{0x2F9A0,0x8353,0x0},{0x2F9A1,0x83CA,0x0},{0x2F9A2,0x83CC,0x0},
    {0x2F9A3,0x83DC,0x0},{0x2F9A4,0x26C36,0x0},{0x2F9A5,0x26D6B,0x0},{0x2F9A6,0x26CD5,0x0},{0x2F9A7,0x452B,0x0},{0x2F9A8,0x84F1,0x0},
    {0x2F9A9,0x84F3,0x0},{0x2F9AA,0x8516,0x0},{0x2F9AB,0x273CA,0x0},{0x2F9AC,0x8564,0x0},{0x2F9AD,0x26F2C,0x0},{0x2F9AE,0x455D,0x0},
    {0x2F9AF,0x4561,0x0},{0x2F9B0,0x26FB1,0x0},{0x2F9B1,0x270D2,0x0},{0x2F9B2,0x456B,0x0},{0x2F9B3,0x8650,0x0},{0x2F9B4,0x865C,0x0},
    {0x2F9B5,0x8667,0x0},{0x2F9B6,0x8669,0x0},{0x2F9B7,0x86A9,0x0},{0x2F9B8,0x8688,0x0},{0x2F9B9,0x870E,0x0},{0x2F9BA,0x86E2,0x0},
    {0x2F9BB,0x8779,0x0},{0x2F9BC,0x8728,0x0},{0x2F9BD,0x876B,0x0},{0x2F9BE,0x8786,0x0},{0x2F9BF,0x45D7,0x0},{0x2F9C0,0x87E1,0x0},
    {0x2F9C1,0x8801,0x0},{0x2F9C2,0x45F9,0x0},{0x2F9C3,0x8860,0x0},{0x2F9C4,0x8863,0x0},{0x2F9C5,0x27667,0x0},{0x2F9C6,0x88D7,0x0},
    {0x2F9C7,0x88DE,0x0},{0x2F9C8,0x4635,0x0},{0x2F9C9,0x88FA,0x0},{0x2F9CA,0x34BB,0x0},{0x2F9CB,0x278AE,0x0},{0x2F9CC,0x27966,0x0},
    {0x2F9CD,0x46BE,0x0},{0x2F9CE,0x46C7,0x0},{0x2F9CF,0x8AA0,0x0},{0x2F9D0,0x8AED,0x0},{0x2F9D1,0x8B8A,0x0},{0x2F9D2,0x8C55,0x0},
    {0x2F9D3,0x27CA8,0x0},{0x2F9D4,0x8CAB,0x0},{0x2F9D5,0x8CC1,0x0},{0x2F9D6,0x8D1B,0x0},{0x2F9D7,0x8D77,0x0},{0x2F9D8,0x27F2F,0x0},
    {0x2F9D9,0x20804,0x0},{0x2F9DA,0x8DCB,0x0},{0x2F9DB,0x8DBC,0x0},{0x2F9DC,0x8DF0,0x0},{0x2F9DD,0x208DE,0x0},{0x2F9DE,0x8ED4,0x0},
    {0x2F9DF,0x8F38,0x0},{0x2F9E0,0x285D2,0x0},{0x2F9E1,0x285ED,0x0},{0x2F9E2,0x9094,0x0},{0x2F9E3,0x90F1,0x0},{0x2F9E4,0x9111,0x0},
    {0x2F9E5,0x2872E,0x0},{0x2F9E6,0x911B,0x0},{0x2F9E7,0x9238,0x0},{0x2F9E8,0x92D7,0x0},{0x2F9E9,0x92D8,0x0},{0x2F9EA,0x927C,0x0},
    {0x2F9EB,0x93F9,0x0},{0x2F9EC,0x9415,0x0},{0x2F9ED,0x28BFA,0x0},{0x2F9EE,0x958B,0x0},{0x2F9EF,0x4995,0x0},{0x2F9F0,0x95B7,0x0},
    {0x2F9F1,0x28D77,0x0},{0x2F9F2,0x49E6,0x0},{0x2F9F3,0x96C3,0x0},{0x2F9F4,0x5DB2,0x0},{0x2F9F5,0x9723,0x0},{0x2F9F6,0x29145,0x0},
    {0x2F9F7,0x2921A,0x0},{0x2F9F8,0x4A6E,0x0},{0x2F9F9,0x4A76,0x0},{0x2F9FA,0x97E0,0x0},{0x2F9FB,0x2940A,0x0},{0x2F9FC,0x4AB2,0x0},
    {0x2F9FD,0x29496,0x0},{0x2F9FE,0x980B,0x0},{0x2F9FF,0x980B,0x0},{0x2FA00,0x9829,0x0},{0x2FA01,0x295B6,0x0},{0x2FA02,0x98E2,0x0},
    {0x2FA03,0x4B33,0x0},{0x2FA04,0x9929,0x0},{0x2FA05,0x99A7,0x0},{0x2FA06,0x99C2,0x0},{0x2FA07,0x99FE,0x0},{0x2FA08,0x4BCE,0x0},
    {0x2FA09,0x29B30,0x0},{0x2FA0A,0x9B12,0x0},{0x2FA0B,0x9C40,0x0},{0x2FA0C,0x9CFD,0x0},{0x2FA0D,0x4CCE,0x0},{0x2FA0E,0x4CED,0x0},
    {0x2FA0F,0x9D67,0x0},{0x2FA10,0x2A0CE,0x0},{0x2FA11,0x4CF8,0x0},{0x2FA12,0x2A105,0x0},{0x2FA13,0x2A20E,0x0},{0x2FA14,0x2A291,0x0},
    {0x2FA15,0x9EBB,0x0},{0x2FA16,0x4D56,0x0},{0x2FA17,0x9EF9,0x0},{0x2FA18,0x9EFE,0x0},{0x2FA19,0x9F05,0x0},{0x2FA1A,0x9F0F,0x0},
    {0x2FA1B,0x9F16,0x0},{0x2FA1C,0x9F3B,0x0},{0x2FA1D,0x2A600,0x0},
};
// Non-ASCII code points whose case folding is an ASCII letter: {code point, folded}.
inline constexpr char32_t ascii_case_folds[][2] = {{0x17F,0x73},{0x212A,0x6B}};
// ---- END GENERATED UNICODE TABLES -----------------------------------------------------------------------------------
// clang-format on

}  // namespace detail::unicode

namespace detail {

// Binary search over sorted {first, last} ranges.
template <size_t N>
bool in_ranges(const char32_t (&table)[N][2], char32_t cp) {
    size_t low = 0, high = N;
    while (low < high) {
        size_t mid = (low + high) / 2;
        if (table[mid][1] < cp) low = mid + 1;
        else high = mid;
    }
    return low < N && table[low][0] <= cp;
}

inline bool is_letter(char32_t cp) {
    if (cp < 0x80) return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z');
    return in_ranges(unicode::letter_ranges, cp);
}
inline bool is_number(char32_t cp) {
    if (cp < 0x80) return cp >= '0' && cp <= '9';
    return in_ranges(unicode::number_ranges, cp);
}
inline bool is_white_space(char32_t cp) {
    if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
    return in_ranges(unicode::white_space_ranges, cp);
}

// Simple case folding, as far as the tokenizers' (?i:'s|'t|...) needs: ASCII, and the few letters that fold onto it.
inline char32_t fold_case(char32_t cp) {
    if (cp >= 'A' && cp <= 'Z') return cp + 32;
    if (cp < 0x80) return cp;
    for (const auto& fold : unicode::ascii_case_folds)
        if (fold[0] == cp) return fold[1];
    return cp;
}

// ---- NFC: canonical decomposition, canonical order, canonical composition (UAX #15) ---------------------------------

inline int combining_class(char32_t cp) {
    if (cp < 0x300) return 0;
    const auto& runs = unicode::combining_class_runs;
    size_t low = 0, high = std::size(runs);
    while (low < high) {
        size_t mid = (low + high) / 2;
        if (runs[mid][1] < cp) low = mid + 1;
        else high = mid;
    }
    return low < std::size(runs) && runs[low][0] <= cp ? static_cast<int>(runs[low][2]) : 0;
}

// Hangul syllables decompose and compose by arithmetic, not by table (Unicode §3.12).
inline constexpr char32_t hangul_s = 0xAC00, hangul_l = 0x1100, hangul_v = 0x1161, hangul_t = 0x11A7;
inline constexpr char32_t hangul_v_count = 21, hangul_t_count = 28, hangul_n_count = 588, hangul_s_count = 11172;

inline void decompose_canonically(char32_t cp, std::u32string& out) {
    if (cp >= hangul_s && cp < hangul_s + hangul_s_count) {
        char32_t s = cp - hangul_s;
        out += hangul_l + s / hangul_n_count;
        out += hangul_v + (s % hangul_n_count) / hangul_t_count;
        if (s % hangul_t_count) out += hangul_t + s % hangul_t_count;
        return;
    }
    const auto& table = unicode::canonical_decompositions;
    size_t low = 0, high = std::size(table);
    while (low < high) {
        size_t mid = (low + high) / 2;
        if ((table[mid][0] & 0x7FFFFFFF) < cp) low = mid + 1;
        else high = mid;
    }
    if (low < std::size(table) && (table[low][0] & 0x7FFFFFFF) == cp) {
        decompose_canonically(table[low][1], out);
        if (table[low][2]) decompose_canonically(table[low][2], out);
        return;
    }
    out += cp;
}

// The primary composite of a pair, or 0.
inline char32_t compose_pair(char32_t first, char32_t second) {
    if (first >= hangul_l && first < hangul_l + 19 && second >= hangul_v && second < hangul_v + hangul_v_count)
        return hangul_s + ((first - hangul_l) * hangul_v_count + (second - hangul_v)) * hangul_t_count;
    if (first >= hangul_s && first < hangul_s + hangul_s_count && (first - hangul_s) % hangul_t_count == 0 &&
        second > hangul_t && second < hangul_t + hangul_t_count)
        return first + (second - hangul_t);
    static const std::unordered_map<uint64_t, char32_t> compositions = [] {
        std::unordered_map<uint64_t, char32_t> map;
        for (const auto& entry : unicode::canonical_decompositions)
            if (entry[0] & 0x80000000) map[uint64_t{entry[1]} << 32 | entry[2]] = entry[0] & 0x7FFFFFFF;
        return map;
    }();
    auto found = compositions.find(uint64_t{first} << 32 | second);
    return found == compositions.end() ? 0 : found->second;
}

inline std::string nfc(std::string_view text) {
    // Nothing below U+0300 decomposes or combines, and most text is all below it: return it untouched.
    bool simple = true;
    for (char ch : text)
        if (static_cast<unsigned char>(ch) >= 0xCC) simple = false;  // a lead byte of U+0300 or above
    if (simple) return std::string(text);
    std::u32string decomposed;
    for (char32_t cp : to_code_points(text)) decompose_canonically(cp, decomposed);
    // Canonical order: a stable sort of each run of non-starters by combining class.
    for (size_t i = 1; i < decomposed.size(); ++i) {
        int cc = combining_class(decomposed[i]);
        if (cc == 0) continue;
        for (size_t j = i; j > 0 && combining_class(decomposed[j - 1]) > cc; --j) std::swap(decomposed[j - 1], decomposed[j]);
    }
    // Compose each character with the last starter unless a character in between blocks it.
    std::u32string composed;
    size_t starter = std::u32string::npos;
    int last_class = -1;
    for (char32_t cp : decomposed) {
        int cc = combining_class(cp);
        if (starter != std::u32string::npos) {
            bool adjacent = composed.size() == starter + 1;
            if (adjacent || (last_class != 0 && last_class < cc)) {
                if (char32_t both = compose_pair(composed[starter], cp)) {
                    composed[starter] = both;
                    continue;
                }
            }
        }
        if (cc == 0) starter = composed.size();
        last_class = cc;
        composed += cp;
    }
    std::string out;
    for (char32_t cp : composed) append_utf8(out, cp);
    return out;
}

}  // namespace detail

// ==== D REGEX ========================================================================================================
// The pre-tokenizers' split patterns, matched by a small backtracking engine over code points; the GPT-2 byte-to-
// character map.

namespace detail {

// ---- Regex ----------------------------------------------------------------------------------------------------------
// The pre-tokenizer patterns are written for Oniguruma (Hugging Face) and PCRE: leftmost-first alternation, greedy
// quantifiers that backtrack, \p{L}-style classes, (?i:...) and (?!...). This is a small backtracking matcher for that
// subset over code points; anything outside it is an error naming the construct, never a silent difference. Compiled
// once per tokenizer. A run of one character class (\p{L}+) is matched in a loop, not by recursion, so long words cost
// no stack.

class Regex {
public:
    Regex() = default;
    explicit Regex(std::string pattern) : pattern_(std::move(pattern)) {
        pattern_cp_ = to_code_points(pattern_);
        root_ = parse_alternation(false);
        if (at_ < pattern_cp_.size()) unsupported("an unmatched ')'");
    }

    const std::string& pattern() const { return pattern_; }

    // Successive non-overlapping leftmost matches, as [begin, end) code point offsets; empty matches are skipped.
    std::vector<std::pair<size_t, size_t>> find_all(std::u32string_view text) const {
        std::vector<std::pair<size_t, size_t>> matches;
        size_t start = 0;
        while (start < text.size()) {
            size_t end = 0;
            bool found = false;
            size_t at = start;
            for (; at < text.size(); ++at) {
                auto record = [&](size_t p) {
                    end = p;
                    return true;
                };
                if (match_node(text, root_, at, Continuation::of(record)) && end > at) {
                    found = true;
                    break;
                }
            }
            if (!found) break;
            matches.emplace_back(at, end);
            start = end;
        }
        return matches;
    }

private:
    // What a node matches next: a non-owning callable, so backtracking allocates nothing.
    struct Continuation {
        const void* self;
        bool (*call)(const void*, size_t);
        bool operator()(size_t position) const { return call(self, position); }
        template <class F>
        static Continuation of(const F& f) {
            return {&f, [](const void* s, size_t p) { return (*static_cast<const F*>(s))(p); }};
        }
    };

    struct ClassItem {
        enum class Kind { Range, Letter, Number, Mark, Punctuation, WhiteSpace } kind = Kind::Range;
        char32_t first = 0, last = 0;
        bool negated = false;  // \P{L}, \S
    };
    struct Node {
        enum class Kind { Char, Class, Any, Group, Repeat, LookAhead, Start, End } kind = Kind::Char;
        char32_t ch = 0;
        bool fold = false;                        // (?i:...) in force
        std::vector<ClassItem> items;             // Class
        bool negated = false;                     // Class [^...]; LookAhead (?!...)
        std::vector<std::vector<int>> branches;   // Group: alternatives, each a sequence of nodes
        int child = -1;                           // Repeat, LookAhead
        int min = 0, max = -1;                    // Repeat; max -1: unbounded
        bool greedy = true;
    };

    [[noreturn]] void unsupported(std::string_view what) const {
        fail("unsupported regex construct ", what, " at character ", at_, " of the pattern \"", pattern_, "\"");
    }
    bool more() const { return at_ < pattern_cp_.size(); }
    char32_t peek() const { return more() ? pattern_cp_[at_] : 0; }
    bool take(char32_t c) {
        if (peek() != c || !more()) return false;
        ++at_;
        return true;
    }
    int add(Node node) {
        nodes_.push_back(std::move(node));
        return static_cast<int>(nodes_.size()) - 1;
    }

    int parse_alternation(bool fold) {
        Node group;
        group.kind = Node::Kind::Group;
        group.branches.push_back(parse_sequence(fold));
        while (take('|')) group.branches.push_back(parse_sequence(fold));
        return add(std::move(group));
    }

    std::vector<int> parse_sequence(bool fold) {
        std::vector<int> sequence;
        while (more() && peek() != '|' && peek() != ')') {
            int atom = parse_atom(fold);
            sequence.push_back(parse_quantifier(atom));
        }
        return sequence;
    }

    int parse_quantifier(int atom) {
        int min = -1, max = -1;
        if (take('*')) min = 0;
        else if (take('+')) min = 1;
        else if (take('?')) min = 0, max = 1;
        else if (peek() == '{') {
            ++at_;
            auto number = [&] {
                if (!std::isdigit(static_cast<int>(peek()))) unsupported("a '{' that is not a {n,m} count");
                int value = 0;
                while (more() && std::isdigit(static_cast<int>(peek()))) value = value * 10 + static_cast<int>(pattern_cp_[at_++] - '0');
                return value;
            };
            min = max = number();
            if (take(',')) max = peek() == '}' ? -1 : number();
            if (!take('}')) unsupported("an unterminated {n,m}");
        }
        if (min < 0) return atom;
        Node repeat;
        repeat.kind = Node::Kind::Repeat;
        repeat.child = atom;
        repeat.min = min;
        repeat.max = max;
        if (take('?')) repeat.greedy = false;
        else if (peek() == '+') unsupported("a possessive quantifier");
        return add(std::move(repeat));
    }

    int parse_atom(bool fold) {
        char32_t c = pattern_cp_[at_++];
        Node node;
        node.fold = fold;
        switch (c) {
        case '(': {
            bool inner_fold = fold;
            if (take('?')) {
                if (take(':')) {
                } else if (take('i')) {
                    if (!take(':')) unsupported("an inline flag group other than (?i:...)");
                    inner_fold = true;
                } else if (take('=') || take('!')) {
                    node.kind = Node::Kind::LookAhead;
                    node.negated = pattern_cp_[at_ - 1] == '!';
                    node.child = parse_alternation(fold);
                    if (!take(')')) unsupported("an unterminated group");
                    return add(std::move(node));
                } else {
                    unsupported("a group of the form (?...) other than (?:, (?i:, (?=, (?!");
                }
            }
            int group = parse_alternation(inner_fold);
            if (!take(')')) unsupported("an unterminated group");
            return group;
        }
        case '[': return parse_class(fold);
        case '.': node.kind = Node::Kind::Any; return add(std::move(node));
        case '^': node.kind = Node::Kind::Start; return add(std::move(node));
        case '$': node.kind = Node::Kind::End; return add(std::move(node));
        case '*': case '+': case '?': case '{': unsupported("a quantifier with nothing before it");
        case '\\': {
            ClassItem item;
            if (parse_escape(item)) {
                node.kind = Node::Kind::Class;
                node.items.push_back(item);
            } else {
                node.ch = item.first;
            }
            return add(std::move(node));
        }
        default: node.ch = c; return add(std::move(node));
        }
    }

    // After a backslash: a class escape (returns true, item set) or one literal character (false, item.first).
    bool parse_escape(ClassItem& item) {
        if (!more()) unsupported("a trailing backslash");
        char32_t c = pattern_cp_[at_++];
        switch (c) {
        case 'r': item.first = '\r'; return false;
        case 'n': item.first = '\n'; return false;
        case 't': item.first = '\t'; return false;
        case 'f': item.first = '\f'; return false;
        case 'v': item.first = '\v'; return false;
        case 's': case 'S': item.kind = ClassItem::Kind::WhiteSpace; item.negated = c == 'S'; return true;
        case 'p': case 'P': {
            item.negated = c == 'P';
            std::string name;
            if (take('{')) {
                while (more() && peek() != '}') append_utf8(name, pattern_cp_[at_++]);
                if (!take('}')) unsupported("an unterminated \\p{...}");
            } else if (more()) {
                append_utf8(name, pattern_cp_[at_++]);
            }
            if (name == "L") item.kind = ClassItem::Kind::Letter;
            else if (name == "N") item.kind = ClassItem::Kind::Number;
            else if (name == "M") item.kind = ClassItem::Kind::Mark;
            else if (name == "P") item.kind = ClassItem::Kind::Punctuation;
            else unsupported("\\p{" + name + "} (supported: \\p{L}, \\p{N}, \\p{M}, \\p{P})");
            return true;
        }
        default:
            if (std::isalnum(static_cast<int>(c < 0x80 ? c : 0))) {
                std::string escape = "\\";
                append_utf8(escape, c);
                unsupported(escape);
            }
            item.first = c;  // an escaped punctuation character stands for itself
            return false;
        }
    }

    int parse_class(bool fold) {
        Node node;
        node.kind = Node::Kind::Class;
        node.fold = fold;
        node.negated = take('^');
        bool first = true;
        while (more() && (peek() != ']' || first)) {
            first = false;
            ClassItem item;
            char32_t c = pattern_cp_[at_++];
            if (c == '[') unsupported("a nested character class");
            if (c == '\\') {
                if (parse_escape(item)) {
                    node.items.push_back(item);
                    continue;
                }
                c = item.first;
            }
            item.kind = ClassItem::Kind::Range;
            item.first = item.last = c;
            if (peek() == '-' && at_ + 1 < pattern_cp_.size() && pattern_cp_[at_ + 1] != ']') {
                ++at_;
                char32_t last = pattern_cp_[at_++];
                if (last == '\\') {
                    ClassItem end;
                    if (parse_escape(end)) unsupported("a class escape as a range's end");
                    last = end.first;
                }
                item.last = last;
            }
            node.items.push_back(item);
        }
        if (!take(']')) unsupported("an unterminated character class");
        return add(std::move(node));
    }

    static bool item_matches(const ClassItem& item, char32_t c) {
        bool in = false;
        switch (item.kind) {
        case ClassItem::Kind::Range: in = c >= item.first && c <= item.last; break;
        case ClassItem::Kind::Letter: in = is_letter(c); break;
        case ClassItem::Kind::Number: in = is_number(c); break;
        case ClassItem::Kind::Mark: in = c >= 0x300 && in_ranges(unicode::mark_ranges, c); break;
        case ClassItem::Kind::Punctuation: in = in_ranges(unicode::punctuation_ranges, c); break;
        case ClassItem::Kind::WhiteSpace: in = is_white_space(c); break;
        }
        return in != item.negated;
    }

    bool char_matches(const Node& node, char32_t c) const {
        switch (node.kind) {
        case Node::Kind::Char: return node.fold ? fold_case(c) == fold_case(node.ch) : c == node.ch;
        case Node::Kind::Any: return c != '\n';
        case Node::Kind::Class: {
            bool in = false;
            for (const ClassItem& item : node.items)
                if (item_matches(item, c) || (node.fold && item_matches(item, fold_case(c)))) {
                    in = true;
                    break;
                }
            return in != node.negated;
        }
        default: return false;
        }
    }
    static bool is_single(const Node& node) {
        return node.kind == Node::Kind::Char || node.kind == Node::Kind::Class || node.kind == Node::Kind::Any;
    }

    bool match_sequence(std::u32string_view text, const std::vector<int>& sequence, size_t index, size_t position,
                        Continuation next) const {
        if (index == sequence.size()) return next(position);
        auto rest = [&](size_t p) { return match_sequence(text, sequence, index + 1, p, next); };
        return match_node(text, sequence[index], position, Continuation::of(rest));
    }

    bool match_node(std::u32string_view text, int id, size_t position, Continuation next) const {
        const Node& node = nodes_[static_cast<size_t>(id)];
        switch (node.kind) {
        case Node::Kind::Char:
        case Node::Kind::Class:
        case Node::Kind::Any:
            return position < text.size() && char_matches(node, text[position]) && next(position + 1);
        case Node::Kind::Start: return position == 0 && next(position);
        case Node::Kind::End: return position == text.size() && next(position);
        case Node::Kind::Group:
            for (const auto& branch : node.branches)  // leftmost-first: the first branch that leads to a match wins
                if (match_sequence(text, branch, 0, position, next)) return true;
            return false;
        case Node::Kind::LookAhead: {
            auto accept = [](size_t) { return true; };
            bool found = match_node(text, node.child, position, Continuation::of(accept));
            return found != node.negated && next(position);
        }
        case Node::Kind::Repeat: {
            const Node& child = nodes_[static_cast<size_t>(node.child)];
            if (is_single(child)) {
                size_t limit = node.max < 0 ? text.size() - position : std::min<size_t>(node.max, text.size() - position);
                size_t count = 0;
                while (count < limit && char_matches(child, text[position + count])) ++count;
                if (count < static_cast<size_t>(node.min)) return false;
                if (node.greedy) {
                    for (size_t k = count + 1; k-- > static_cast<size_t>(node.min);)
                        if (next(position + k)) return true;
                } else {
                    for (size_t k = static_cast<size_t>(node.min); k <= count; ++k)
                        if (next(position + k)) return true;
                }
                return false;
            }
            return match_repeat(text, node, 0, position, next);
        }
        }
        return false;
    }

    bool match_repeat(std::u32string_view text, const Node& node, int count, size_t position, Continuation next) const {
        bool can_stop = count >= node.min;
        bool can_go = node.max < 0 || count < node.max;
        auto again = [&](size_t p) { return p != position && match_repeat(text, node, count + 1, p, next); };
        if (node.greedy) {
            if (can_go && match_node(text, node.child, position, Continuation::of(again))) return true;
            return can_stop && next(position);
        }
        if (can_stop && next(position)) return true;
        return can_go && match_node(text, node.child, position, Continuation::of(again));
    }

    std::string pattern_;
    std::u32string pattern_cp_;
    size_t at_ = 0;  // parse position
    std::vector<Node> nodes_;
    int root_ = -1;
};

// The split patterns of the common byte-level vocabularies (also what GGUF's tokenizer.ggml.pre names).
inline constexpr std::string_view gpt2_split_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view llama3_split_pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view qwen2_split_pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's byte-to-unicode map: byte-level vocabularies spell every byte as a printable character (the printable
// Latin-1 bytes as themselves, the rest as U+0100 onwards: a space is "Ġ", a newline "Ċ").
struct ByteLevelMap {
    std::array<std::string, 256> byte_to_text;
    std::unordered_map<char32_t, uint8_t> char_to_byte;
    ByteLevelMap() {
        char32_t next = 256;
        for (int b = 0; b < 256; ++b) {
            bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            char32_t cp = printable ? static_cast<char32_t>(b) : next++;
            append_utf8(byte_to_text[b], cp);
            char_to_byte[cp] = static_cast<uint8_t>(b);
        }
    }
};
inline const ByteLevelMap& byte_level_map() {
    static const ByteLevelMap map;
    return map;
}

}  // namespace detail

// ==== E TOKENIZER COMPONENTS =========================================================================================
// The parts of Hugging Face's pipeline that section 03 declares: added-token matching, normalizers, pre-tokenizers and
// decoders; then the builders that read tokenizer.json (+ tokenizer_config.json), a GGUF vocabulary or llama2.c's
// tokenizer.bin into a Tokenizer's state, refusing by name any component they do not implement.

inline void Tokenizer::encode_sentencepiece(std::string_view text, std::vector<int>& ids) const {
    const State& s = *state_;
    // Split around special pieces; each stretch of plain text gets SentencePiece's dummy-prefix space when it
    // starts the text or follows a special token, as llama.cpp does.
    bool after_special = true;
    size_t start = 0;
    while (start <= text.size()) {
        size_t match_at = text.size();
        int match_id = -1;
        for (size_t i = start; i < text.size() && match_id < 0; ++i)
            for (int id : s.sentencepiece_specials) {
                const std::string& piece = s.id_to_token[id];
                if (text.compare(i, piece.size(), piece) == 0) {
                    match_at = i;
                    match_id = id;
                    break;
                }
            }
        std::string_view plain = text.substr(start, match_at - start);
        if (!plain.empty()) encode_sentencepiece_plain(plain, after_special, ids);
        if (match_id < 0) break;
        ids.push_back(match_id);
        after_special = true;
        start = match_at + s.id_to_token[match_id].size();
    }
}

inline std::vector<Tokenizer::Segment> Tokenizer::split_added_tokens(std::string_view text, bool normalized) const {
    const State& s = *state_;
    const auto& by_first = s.added_by_first_byte[normalized ? 1 : 0];
    std::vector<Segment> segments;
    size_t plain_begin = 0;
    auto is_word = [](char32_t c) { return c == '_' || detail::is_letter(c) || detail::is_number(c); };
    for (size_t i = 0; i < text.size();) {
        const auto& candidates = by_first[static_cast<unsigned char>(text[i])];
        const detail::AddedToken* match = nullptr;
        for (int index : candidates) {
            const detail::AddedToken& token = s.added[static_cast<size_t>(index)];
            if (text.compare(i, token.content.size(), token.content) == 0) {
                match = &token;
                break;
            }
        }
        if (!match) {
            ++i;
            continue;
        }
        size_t start = i, stop = i + match->content.size();
        if (match->single_word) {
            bool word_before = start > 0 && is_word(previous_code_point(text, start));
            bool word_after = stop < text.size() && is_word(detail::code_point_at(text, stop));
            if (word_before || word_after) {
                i = stop;
                continue;
            }
        }
        if (match->lstrip)
            while (start > plain_begin && detail::is_white_space(previous_code_point(text, start)))
                start -= previous_length(text, start);
        if (match->rstrip) {
            int n = 0;
            while (stop < text.size() && detail::is_white_space(detail::code_point_at(text, stop, &n))) stop += static_cast<size_t>(n);
        }
        if (start > plain_begin) segments.push_back({text.substr(plain_begin, start - plain_begin), -1, plain_begin});
        segments.push_back({text.substr(start, stop - start), match->id, start});
        plain_begin = i = stop;
    }
    if (plain_begin < text.size()) segments.push_back({text.substr(plain_begin), -1, plain_begin});
    return segments;
}

inline size_t Tokenizer::previous_length(std::string_view text, size_t end) {
    size_t begin = end - 1;
    while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
    return end - begin;
}

inline char32_t Tokenizer::previous_code_point(std::string_view text, size_t end) {
    return detail::code_point_at(text, end - previous_length(text, end));
}

inline std::string Tokenizer::normalize(std::string_view text) const {
    std::string out(text);
    for (const detail::NormalizerStep& step : state_->normalizers) {
        switch (step.kind) {
        case detail::NormalizerStep::Kind::Prepend:
            if (!out.empty()) out = step.text + out;
            break;
        case detail::NormalizerStep::Kind::Replace: out = replace_all(out, step); break;
        case detail::NormalizerStep::Kind::Nfc: out = detail::nfc(out); break;
        }
    }
    return out;
}

inline std::string Tokenizer::replace_all(const std::string& text, const detail::NormalizerStep& step) {
    std::string out;
    if (step.regex) {
        std::u32string cps = detail::to_code_points(text);
        size_t last = 0;
        for (auto [begin, end] : step.regex->find_all(cps)) {
            for (size_t k = last; k < begin; ++k) detail::append_utf8(out, cps[k]);
            out += step.content;
            last = end;
        }
        for (size_t k = last; k < cps.size(); ++k) detail::append_utf8(out, cps[k]);
        return out;
    }
    if (step.text.empty()) return text;
    size_t at = 0;
    for (size_t found; (found = text.find(step.text, at)) != std::string::npos; at = found + step.text.size())
        out.append(text, at, found - at) += step.content;
    return out.append(text, at);
}

inline void Tokenizer::split_by_matches(const detail::Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                             bool keep_matches, std::vector<detail::Piece>& out) {
    size_t last = 0;
    auto emit = [&](size_t begin, size_t end) {
        if (end > begin) out.push_back({piece.text.substr(begin, end - begin), piece.at_start && begin == 0});
    };
    for (auto [begin, end] : matches) {
        emit(last, begin);
        if (keep_matches) emit(begin, end);
        last = end;
    }
    emit(last, piece.text.size());
}

inline std::vector<std::pair<size_t, size_t>> Tokenizer::byte_matches(const detail::Regex& regex, const std::string& text) {
    std::u32string cps = detail::to_code_points(text);
    std::vector<size_t> offset(cps.size() + 1, 0);
    for (size_t i = 0, at = 0; i < cps.size(); ++i) {
        offset[i] = at;
        at += static_cast<size_t>(std::max(1, detail::utf8_sequence_length(static_cast<unsigned char>(text[at]))));
        offset[i + 1] = at;
    }
    std::vector<std::pair<size_t, size_t>> matches = regex.find_all(cps);
    for (auto& [begin, end] : matches) begin = offset[begin], end = offset[end];
    return matches;
}

inline std::vector<detail::Piece> Tokenizer::pre_tokenize(std::string text, bool at_start) const {
    std::vector<detail::Piece> pieces{{std::move(text), at_start}};
    for (const detail::PreTokenizerStep& step : state_->pre_tokenizers) {
        std::vector<detail::Piece> next;
        for (detail::Piece& piece : pieces) apply_pre_tokenizer(step, piece, next);
        pieces = std::move(next);
    }
    return pieces;
}

inline void Tokenizer::apply_pre_tokenizer(const detail::PreTokenizerStep& step, detail::Piece& piece, std::vector<detail::Piece>& out) {
    using Kind = detail::PreTokenizerStep::Kind;
    switch (step.kind) {
    case Kind::Metaspace: {
        std::string text;
        for (char ch : piece.text) {
            if (ch == ' ') text += step.replacement;
            else text += ch;
        }
        bool prepend = step.prepend == detail::PreTokenizerStep::Prepend::Always ||
                       (step.prepend == detail::PreTokenizerStep::Prepend::First && piece.at_start);
        if (prepend && !detail::starts_with(text, step.replacement)) text = step.replacement + text;
        if (!step.split) {
            out.push_back({std::move(text), piece.at_start});
            return;
        }
        // Behaviour MergedWithNext: each "▁" starts a new piece.
        size_t begin = 0;
        for (size_t at = text.find(step.replacement, 1); at != std::string::npos; at = text.find(step.replacement, at + 1)) {
            if (at > begin) out.push_back({text.substr(begin, at - begin), piece.at_start && begin == 0});
            begin = at;
        }
        if (begin < text.size()) out.push_back({text.substr(begin), piece.at_start && begin == 0});
        return;
    }
    case Kind::ByteLevel: {
        if (step.add_prefix_space && !detail::starts_with(piece.text, " ")) piece.text = " " + piece.text;
        std::vector<detail::Piece> parts;
        if (step.use_regex) split_by_matches(piece, byte_matches(*step.regex, piece.text), true, parts);
        else parts.push_back(std::move(piece));
        const auto& map = detail::byte_level_map();
        for (detail::Piece& part : parts) {
            std::string mapped;
            for (unsigned char byte : part.text) mapped += map.byte_to_text[byte];
            out.push_back({std::move(mapped), part.at_start});
        }
        return;
    }
    case Kind::Split: {
        if (step.regex) {
            split_by_matches(piece, byte_matches(*step.regex, piece.text), !step.remove_matches, out);
            return;
        }
        std::vector<std::pair<size_t, size_t>> matches;
        if (!step.literal.empty())
            for (size_t at = piece.text.find(step.literal); at != std::string::npos; at = piece.text.find(step.literal, at + step.literal.size()))
                matches.emplace_back(at, at + step.literal.size());
        split_by_matches(piece, matches, !step.remove_matches, out);
        return;
    }
    case Kind::Digits: {
        std::vector<std::pair<size_t, size_t>> matches;
        int n = 0;
        for (size_t i = 0; i < piece.text.size(); i += static_cast<size_t>(n)) {
            if (!detail::is_number(detail::code_point_at(piece.text, i, &n))) continue;
            if (!step.individual_digits && !matches.empty() && matches.back().second == i) matches.back().second = i + n;
            else matches.emplace_back(i, i + n);
        }
        split_by_matches(piece, matches, true, out);
        return;
    }
    }
}

inline std::vector<std::optional<std::string>> Tokenizer::all_token_bytes() const {
    const State& s = state();
    std::vector<std::optional<std::string>> out(s.id_to_token.size());
    if (s.kind == Kind::SentencePieceScores) {
        const int not_first = s.bos_id == 0 ? 1 : 0;  // any id but BOS: the dummy-prefix rule applies only at the start
        for (size_t id = 0; id < out.size(); ++id) {
            const auto type = s.types[id];
            if (type == Vocabulary::Type::Control || type == Vocabulary::Type::Unused || type == Vocabulary::Type::Unknown) continue;
            out[id] = sentencepiece_bytes(static_cast<int>(id), not_first);
        }
        return out;
    }
    std::vector<char> special(out.size(), 0);
    for (const detail::AddedToken& added : s.added)
        if (added.special && added.id >= 0 && static_cast<size_t>(added.id) < special.size()) special[static_cast<size_t>(added.id)] = 1;
    const bool byte_level = std::any_of(s.decoders.begin(), s.decoders.end(),
                                        [](const detail::DecoderStep& d) { return d.kind == detail::DecoderStep::Kind::ByteLevel; });
    // Other decoders (Metaspace, Replace, Strip) treat a text's first token apart: decode after an anchor token and
    // keep what the token adds.
    const std::vector<int> anchor = byte_level ? std::vector<int>() : encode("a", false);
    const std::string anchor_text = anchor.empty() ? std::string() : decode(anchor);
    const auto& map = detail::byte_level_map();
    for (size_t id = 0; id < out.size(); ++id) {
        if (special[id] || static_cast<int>(id) == s.unk_id) continue;
        const std::string& token = s.id_to_token[id];
        if (byte_level) {  // each character stands for one byte; an added token's text is itself
            std::string bytes;
            int n = 0;
            bool all = true;
            for (size_t i = 0; i < token.size() && all; i += static_cast<size_t>(n)) {
                auto found = map.char_to_byte.find(detail::code_point_at(token, i, &n));
                if (found == map.char_to_byte.end()) all = false;
                else bytes += static_cast<char>(found->second);
            }
            out[id] = all ? bytes : token;
        } else if (int byte = detail::byte_token_value(token); byte >= 0 && s.byte_fallback) {
            out[id] = std::string(1, static_cast<char>(byte));
        } else if (!anchor.empty()) {
            std::vector<int> ids = anchor;
            ids.push_back(static_cast<int>(id));
            const std::string both = decode(ids);
            if (both.compare(0, anchor_text.size(), anchor_text) == 0) out[id] = both.substr(anchor_text.size());
        }
    }
    return out;
}

inline std::vector<std::string> Tokenizer::apply_decoder(const detail::DecoderStep& step, std::vector<std::string> tokens) {
    using Kind = detail::DecoderStep::Kind;
    switch (step.kind) {
    case Kind::ByteLevel: {  // every character back to its byte; a token with a foreign character stays as is
        const auto& map = detail::byte_level_map();
        std::string bytes;
        for (const std::string& token : tokens) {
            std::string mapped;
            bool all = true;
            int n = 0;
            for (size_t i = 0; i < token.size() && all; i += static_cast<size_t>(n)) {
                auto found = map.char_to_byte.find(detail::code_point_at(token, i, &n));
                if (found == map.char_to_byte.end()) all = false;
                else mapped += static_cast<char>(found->second);
            }
            bytes += all ? mapped : token;
        }
        return {detail::utf8_lossy(bytes)};
    }
    case Kind::Metaspace:  // "▁" becomes a space, except in the first token where it was the prepended one
        for (size_t i = 0; i < tokens.size(); ++i) {
            std::string text;
            for (size_t at = 0; at < tokens[i].size();) {
                if (tokens[i].compare(at, step.pattern.size(), step.pattern) == 0) {
                    if (!(i == 0 && step.drop_first_marker)) text += ' ';
                    at += step.pattern.size();
                } else {
                    text += tokens[i][at++];
                }
            }
            tokens[i] = std::move(text);
        }
        return tokens;
    case Kind::Replace: {
        detail::NormalizerStep replace;
        replace.kind = detail::NormalizerStep::Kind::Replace;
        replace.text = step.pattern;
        replace.content = step.content;
        for (std::string& token : tokens) token = replace_all(token, replace);
        return tokens;
    }
    case Kind::ByteFallback: {  // runs of <0xNN> tokens become their bytes; bytes that are not UTF-8 become U+FFFD
        std::vector<std::string> out;
        std::string bytes;
        size_t byte_count = 0;
        auto flush = [&] {
            if (byte_count == 0) return;
            if (detail::find_invalid_utf8(bytes) == std::string_view::npos) {
                out.push_back(bytes);
            } else {
                for (size_t k = 0; k < byte_count; ++k) out.emplace_back(detail::replacement_character);
            }
            bytes.clear();
            byte_count = 0;
        };
        for (std::string& token : tokens) {
            int byte = detail::byte_token_value(token);
            if (byte >= 0) {
                bytes += static_cast<char>(byte);
                ++byte_count;
            } else {
                flush();
                out.push_back(std::move(token));
            }
        }
        flush();
        return out;
    }
    case Kind::Fuse: {
        std::string all;
        for (const std::string& token : tokens) all += token;
        return {all};
    }
    case Kind::Strip:  // up to `start` leading and `stop` trailing copies of `content`, from each token
        for (std::string& token : tokens) {
            for (int k = 0; k < step.start && detail::starts_with(token, step.content); ++k) token.erase(0, step.content.size());
            for (int k = 0; k < step.stop && detail::ends_with(token, step.content); ++k)
                token.erase(token.size() - step.content.size());
        }
        return tokens;
    }
    return tokens;
}

// ---- Building tokenizers: from a Vocabulary (llama2.c, GGUF) or a tokenizer.json ------------------------------------

namespace detail {

struct TokenizerBuilder {
    using State = Tokenizer::State;

    static Tokenizer wrap(std::shared_ptr<State> state) {
        Tokenizer tokenizer;
        tokenizer.state_ = std::move(state);
        return tokenizer;
    }

    // A token id from tokenizer.json: a whole number in [0, 2^24). No vocabulary comes near 16 million tokens, and the
    // bound keeps a hostile file from asking for gigabytes of id table (or from wrapping an int).
    static int token_id(const Json& value, const std::string& what, const std::string& file) {
        constexpr int64_t limit = int64_t{1} << 24;
        int64_t id = 0;
        try {
            id = value.as_int();
        } catch (const Error& e) {
            fail(file, ": ", what, ": id: ", e.what());
        }
        if (id < 0 || id >= limit) fail(file, ": ", what, " has id ", id, ", outside [0, ", limit, ")");
        return static_cast<int>(id);
    }

    static void find_byte_tokens(State& s) {
        for (int b = 0; b < 256; ++b) {
            char name[8];
            std::snprintf(name, sizeof name, "<0x%02X>", b);
            if (auto found = s.token_to_id.find(name); found != s.token_to_id.end()) s.byte_ids[b] = found->second;
        }
    }

    // Added tokens: their text goes into the id table, and an index by first byte (longest first) finds them fast.
    static void index_added_tokens(State& s) {
        std::stable_sort(s.added.begin(), s.added.end(),
                         [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
        for (size_t i = 0; i < s.added.size(); ++i) {
            const AddedToken& token = s.added[i];
            if (token.id >= static_cast<int>(s.id_to_token.size())) s.id_to_token.resize(static_cast<size_t>(token.id) + 1);
            s.id_to_token[static_cast<size_t>(token.id)] = token.content;
            s.token_to_id.emplace(token.content, token.id);
            if (!token.content.empty())
                s.added_by_first_byte[token.normalized ? 1 : 0][static_cast<unsigned char>(token.content[0])].push_back(static_cast<int>(i));
        }
    }

    static void set_special_strings(State& s) {
        auto text_of = [&](int id) { return id >= 0 && id < static_cast<int>(s.id_to_token.size()) ? s.id_to_token[id] : std::string(); };
        if (s.bos_token.empty()) s.bos_token = text_of(s.bos_id);
        if (s.eos_token.empty() && !s.eos_ids.empty()) s.eos_token = text_of(s.eos_ids[0]);
    }

    static void add_merge(State& s, const std::string& left, const std::string& right, int rank, const std::string& where) {
        auto l = s.token_to_id.find(left), r = s.token_to_id.find(right), both = s.token_to_id.find(left + right);
        if (l == s.token_to_id.end() || r == s.token_to_id.end() || both == s.token_to_id.end())
            fail(where, ": merge ", rank, " (\"", left, "\" + \"", right, "\") uses a token that is not in the vocabulary");
        s.merges.emplace(uint64_t(uint32_t(l->second)) << 32 | uint32_t(r->second), std::make_pair(rank, both->second));
    }

    static PreTokenizerStep split_step(std::string_view pattern) {
        PreTokenizerStep step;
        step.kind = PreTokenizerStep::Kind::Split;
        step.regex = std::make_shared<const Regex>(std::string(pattern));
        return step;
    }
    static PreTokenizerStep byte_level_step(bool use_regex) {
        PreTokenizerStep step;
        step.kind = PreTokenizerStep::Kind::ByteLevel;
        step.use_regex = use_regex;
        if (use_regex) step.regex = std::make_shared<const Regex>(std::string(gpt2_split_pattern));
        return step;
    }

    static Tokenizer from_vocabulary(const Vocabulary& vocab, int bos_id, std::vector<int> eos_ids, std::string source) {
        const int size = static_cast<int>(vocab.pieces.size());
        auto check_id = [&](int id, const char* what) {
            if (id < -1 || id >= size) fail(source, ": the ", what, " id ", id, " is outside the vocabulary (", size, " tokens)");
        };
        check_id(bos_id, "BOS");
        check_id(vocab.unk_id, "unknown-token");
        for (int id : eos_ids) check_id(id, "EOS");
        if (vocab.types.size() != vocab.pieces.size() || (!vocab.scores.empty() && vocab.scores.size() != vocab.pieces.size()))
            fail(source, ": the vocabulary's token types or scores do not match its ", size, " tokens");
        auto s = std::make_shared<State>();
        s->source = std::move(source);
        s->id_to_token = vocab.pieces;
        for (size_t id = 0; id < vocab.pieces.size(); ++id) s->token_to_id.emplace(vocab.pieces[id], static_cast<int>(id));
        s->types = vocab.types;
        s->bos_id = bos_id;
        s->eos_ids = std::move(eos_ids);
        s->add_bos = vocab.add_bos;
        s->add_eos = vocab.add_eos;
        s->chat_template = vocab.chat_template;
        s->unk_id = vocab.unk_id;
        if (vocab.model == Vocabulary::Model::RankedMerges) {
            // GGUF's byte-level BPE: merges ranked by their order; llama.cpp picks the split regex by tokenizer.ggml.pre.
            s->kind = Tokenizer::Kind::Bpe;
            s->unk_id = -1;
            for (size_t rank = 0; rank < vocab.merges.size(); ++rank) {
                const std::string& merge = vocab.merges[rank];
                size_t space = merge.find(' ', 1);
                if (space == std::string::npos) fail(s->source, ": tokenizer.ggml.merges entry ", rank, " (\"", merge, "\") is not \"left right\"");
                add_merge(*s, merge.substr(0, space), merge.substr(space + 1), static_cast<int>(rank), s->source);
            }
            const std::string& pre = vocab.pre;
            if (pre == "llama-bpe" || pre == "llama3" || pre == "smaug-bpe") {
                s->pre_tokenizers = {split_step(llama3_split_pattern), byte_level_step(false)};
                s->ignore_merges = true;
            } else if (pre == "qwen2") {
                s->pre_tokenizers = {split_step(qwen2_split_pattern), byte_level_step(false)};
            } else if (pre == "gpt-2" || pre == "default" || pre.empty()) {
                s->pre_tokenizers = {byte_level_step(true)};
            } else {
                fail(s->source, ": unsupported GGUF tokenizer.ggml.pre \"", pre, "\" (supported: llama-bpe, qwen2, gpt-2, default)");
            }
            DecoderStep byte_level;
            byte_level.kind = DecoderStep::Kind::ByteLevel;
            s->decoders = {byte_level};
            for (size_t id = 0; id < vocab.types.size(); ++id) {
                auto type = vocab.types[id];
                if (type == Vocabulary::Type::Control || type == Vocabulary::Type::UserDefined)
                    s->added.push_back({static_cast<int>(id), vocab.pieces[id], type == Vocabulary::Type::Control});
            }
            index_added_tokens(*s);
        } else {
            s->kind = Tokenizer::Kind::SentencePieceScores;
            s->scores = vocab.scores;
            s->add_space_prefix = vocab.add_space_prefix;
            for (size_t id = 0; id < vocab.pieces.size(); ++id) {
                const std::string& piece = vocab.pieces[id];
                auto type = vocab.types[id];
                if (type == Vocabulary::Type::Byte) {
                    int byte = byte_token_value(piece);
                    if (byte < 0) fail(s->source, ": token ", id, " is a byte token but is spelled \"", piece, "\", not <0xHH>");
                    s->byte_ids[byte] = static_cast<int>(id);
                }
                // Pieces matched whole in the input text (parse_special in llama.cpp): control, user-defined, unknown.
                if ((type == Vocabulary::Type::Control || type == Vocabulary::Type::UserDefined ||
                     type == Vocabulary::Type::Unknown) && !piece.empty())
                    s->sentencepiece_specials.push_back(static_cast<int>(id));
            }
            // Longest first, so "<|end|>" is not cut short by a shorter special that prefixes it.
            std::stable_sort(s->sentencepiece_specials.begin(), s->sentencepiece_specials.end(),
                             [&](int a, int b) { return vocab.pieces[a].size() > vocab.pieces[b].size(); });
        }
        set_special_strings(*s);
        return wrap(std::move(s));
    }

    // ---- tokenizer.json ----

    struct Reader {  // names the file and the component in every message
        const std::string& file;
        [[noreturn]] void unsupported(std::string_view what, std::string_view name) const {
            fail(file, ": unsupported ", what, " \"", name, "\" (this tokenizer reads BPE models as Llama, Mistral, Qwen and GPT-2 "
                 "write them)");
        }
        static std::string type_of(const Json& component) {
            const Json* type = component.find("type");
            return type && type->is_string() ? type->as_string() : "";
        }
        static bool flag(const Json& object, std::string_view key, bool fallback) {
            const Json* value = object.find(key);
            return value && value->is_bool() ? value->as_bool() : fallback;
        }
        std::string text(const Json& object, std::string_view key) const {
            const Json* value = object.find(key);
            if (!value || !value->is_string()) fail(file, ": ", type_of(object), " needs a string field \"", key, "\"");
            return value->as_string();
        }
        // A pattern: {"String": "..."} or {"Regex": "..."}.
        std::pair<std::string, bool> pattern(const Json& object) const {
            const Json& p = object.at("pattern");
            if (const Json* literal = p.find("String")) return {literal->as_string(), false};
            if (const Json* regex = p.find("Regex")) return {regex->as_string(), true};
            fail(file, ": ", type_of(object), " has a pattern that is neither String nor Regex");
        }
        PreTokenizerStep::Prepend prepend_scheme(const Json& object) const {
            if (const Json* scheme = object.find("prepend_scheme"); scheme && scheme->is_string()) {
                if (scheme->as_string() == "always") return PreTokenizerStep::Prepend::Always;
                if (scheme->as_string() == "first") return PreTokenizerStep::Prepend::First;
                if (scheme->as_string() == "never") return PreTokenizerStep::Prepend::Never;
                unsupported("Metaspace prepend_scheme", scheme->as_string());
            }
            return flag(object, "add_prefix_space", true) ? PreTokenizerStep::Prepend::Always : PreTokenizerStep::Prepend::Never;
        }

        void normalizers(const Json& n, std::vector<NormalizerStep>& out) const {
            if (n.is_null()) return;
            std::string type = type_of(n);
            if (type == "Sequence") {
                for (const Json& inner : n.at("normalizers").as_array()) normalizers(inner, out);
            } else if (type == "Prepend") {
                NormalizerStep step;
                step.text = text(n, "prepend");
                out.push_back(std::move(step));
            } else if (type == "Replace") {
                auto [pattern_text, is_regex] = pattern(n);
                NormalizerStep step;
                step.kind = NormalizerStep::Kind::Replace;
                if (is_regex) step.regex = std::make_shared<const Regex>(pattern_text);
                else step.text = pattern_text;
                step.content = text(n, "content");
                out.push_back(std::move(step));
            } else if (type == "NFC") {
                NormalizerStep step;
                step.kind = NormalizerStep::Kind::Nfc;
                out.push_back(std::move(step));
            } else {
                unsupported("normalizer", type);
            }
        }

        void pre_tokenizers(const Json& p, std::vector<PreTokenizerStep>& out) const {
            if (p.is_null()) return;
            std::string type = type_of(p);
            if (type == "Sequence") {
                for (const Json& inner : p.at("pretokenizers").as_array()) pre_tokenizers(inner, out);
            } else if (type == "Metaspace") {
                PreTokenizerStep step;
                step.kind = PreTokenizerStep::Kind::Metaspace;
                step.replacement = text(p, "replacement");
                step.prepend = prepend_scheme(p);
                step.split = flag(p, "split", true);
                out.push_back(std::move(step));
            } else if (type == "ByteLevel") {
                PreTokenizerStep step = byte_level_step(flag(p, "use_regex", true));
                step.add_prefix_space = flag(p, "add_prefix_space", false);
                out.push_back(std::move(step));
            } else if (type == "Split") {
                auto [pattern_text, is_regex] = pattern(p);
                PreTokenizerStep step;
                step.kind = PreTokenizerStep::Kind::Split;
                if (is_regex) step.regex = std::make_shared<const Regex>(pattern_text);
                else step.literal = pattern_text;
                std::string behavior = text(p, "behavior");
                if (behavior == "Removed") step.remove_matches = true;
                else if (behavior != "Isolated") unsupported("Split behavior", behavior);
                if (flag(p, "invert", false)) unsupported("Split option", "invert: true");
                out.push_back(std::move(step));
            } else if (type == "Digits") {
                PreTokenizerStep step;
                step.kind = PreTokenizerStep::Kind::Digits;
                step.individual_digits = flag(p, "individual_digits", false);
                out.push_back(std::move(step));
            } else {
                unsupported("pre_tokenizer", type);
            }
        }

        void decoders(const Json& d, std::vector<DecoderStep>& out) const {
            if (d.is_null()) return;
            std::string type = type_of(d);
            DecoderStep step;
            if (type == "Sequence") {
                for (const Json& inner : d.at("decoders").as_array()) decoders(inner, out);
                return;
            } else if (type == "ByteLevel") {
                step.kind = DecoderStep::Kind::ByteLevel;
            } else if (type == "Metaspace") {
                step.kind = DecoderStep::Kind::Metaspace;
                step.pattern = text(d, "replacement");
                step.drop_first_marker = prepend_scheme(d) != PreTokenizerStep::Prepend::Never;
            } else if (type == "Replace") {
                auto [pattern_text, is_regex] = pattern(d);
                if (is_regex) unsupported("decoder Replace with a", "Regex pattern");
                step.kind = DecoderStep::Kind::Replace;
                step.pattern = pattern_text;
                step.content = text(d, "content");
            } else if (type == "ByteFallback") {
                step.kind = DecoderStep::Kind::ByteFallback;
            } else if (type == "Fuse") {
                step.kind = DecoderStep::Kind::Fuse;
            } else if (type == "Strip") {
                step.kind = DecoderStep::Kind::Strip;
                step.content = text(d, "content");
                step.start = static_cast<int>(d.at("start").as_int());
                step.stop = static_cast<int>(d.at("stop").as_int());
            } else {
                unsupported("decoder", type);
            }
            out.push_back(std::move(step));
        }

        void post_processor(const Json& p, State& s) const {
            if (p.is_null()) return;
            s.has_post_processor = true;
            std::string type = type_of(p);
            if (type == "Sequence") {
                for (const Json& inner : p.at("processors").as_array()) post_processor(inner, s);
            } else if (type == "ByteLevel") {
                // Only moves offsets (trim_offsets): the ids are unchanged.
            } else if (type == "TemplateProcessing") {
                s.has_template = true;
                s.template_items.clear();
                const Json& specials = p.at("special_tokens");
                for (const Json& item : p.at("single").as_array()) {
                    if (const Json* sequence = item.find("Sequence")) {
                        if (sequence->at("id").as_string() != "A") unsupported("TemplateProcessing single sequence", sequence->at("id").as_string());
                        s.template_items.push_back({true, {}});
                    } else if (const Json* special = item.find("SpecialToken")) {
                        const std::string& name = special->at("id").as_string();
                        const Json* entry = specials.find(name);
                        if (!entry) fail(file, ": TemplateProcessing uses special token \"", name, "\" that special_tokens does not list");
                        std::vector<int> ids;
                        for (const Json& id : entry->at("ids").as_array()) ids.push_back(static_cast<int>(id.as_int()));
                        s.template_items.push_back({false, std::move(ids)});
                    } else {
                        fail(file, ": TemplateProcessing item is neither Sequence nor SpecialToken");
                    }
                }
            } else {
                unsupported("post_processor", type);
            }
        }
    };

    // A token string from tokenizer_config.json: "<s>", or an AddedToken object {"content": "<s>", ...}, or null.
    static std::string config_token(const Json& config, std::string_view key) {
        const Json* value = config.find(key);
        if (!value) return "";
        if (value->is_string()) return value->as_string();
        if (const Json* content = value->find("content"); content && content->is_string()) return content->as_string();
        return "";
    }

    static Tokenizer from_hugging_face(const Json& json, const Json* config, const std::string& file) {
        auto s = std::make_shared<State>();
        s->source = file;
        s->kind = Tokenizer::Kind::Bpe;
        Reader read{file};
        try {
            const Json& model = json.at("model");
            std::string type = Reader::type_of(model);
            if (type.empty() && model.find("merges")) type = "BPE";
            if (type != "BPE") read.unsupported("model type", type);
            for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
                if (const Json* v = model.find(key); v && v->is_string() && !v->as_string().empty())
                    read.unsupported(std::string("BPE option ") + key, v->as_string());
            if (const Json* dropout = model.find("dropout"); dropout && dropout->is_number() && dropout->as_number() != 0)
                read.unsupported("BPE option", "dropout");
            s->byte_fallback = Reader::flag(model, "byte_fallback", false);
            s->fuse_unk = Reader::flag(model, "fuse_unk", false);
            s->ignore_merges = Reader::flag(model, "ignore_merges", false);

            const auto& vocab = model.at("vocab").as_object();
            int largest = -1;
            for (const auto& [token, id] : vocab) largest = std::max(largest, token_id(id, "vocab token \"" + token + "\"", file));
            s->id_to_token.resize(static_cast<size_t>(largest + 1));
            s->token_to_id.reserve(vocab.size());
            for (const auto& [token, id] : vocab) {
                int value = token_id(id, "vocab token \"" + token + "\"", file);
                s->id_to_token[static_cast<size_t>(value)] = token;
                s->token_to_id.emplace(token, value);
            }
            const auto& merges = model.at("merges").as_array();
            s->merges.reserve(merges.size());
            for (size_t rank = 0; rank < merges.size(); ++rank) {
                const Json& merge = merges[rank];
                if (merge.is_string()) {  // "left right"
                    const std::string& both = merge.as_string();
                    size_t space = both.find(' ', 1);
                    if (space == std::string::npos) fail(file, ": merge ", rank, " (\"", both, "\") is not \"left right\"");
                    add_merge(*s, both.substr(0, space), both.substr(space + 1), static_cast<int>(rank), file);
                } else {  // ["left", "right"]
                    const auto& pair = merge.as_array();
                    if (pair.size() != 2) fail(file, ": merge ", rank, " is not a pair");
                    add_merge(*s, pair[0].as_string(), pair[1].as_string(), static_cast<int>(rank), file);
                }
            }
            if (const Json* added = json.find("added_tokens"); added && added->is_array())
                for (const Json& token : added->as_array())
                    s->added.push_back({token_id(token.at("id"), "added token", file), token.at("content").as_string(),
                                        Reader::flag(token, "special", false), Reader::flag(token, "lstrip", false),
                                        Reader::flag(token, "rstrip", false), Reader::flag(token, "single_word", false),
                                        Reader::flag(token, "normalized", false)});
            index_added_tokens(*s);
            find_byte_tokens(*s);
            if (const Json* unk = model.find("unk_token"); unk && unk->is_string()) {
                auto found = s->token_to_id.find(unk->as_string());
                if (found == s->token_to_id.end()) fail(file, ": unk_token \"", unk->as_string(), "\" is not in the vocabulary");
                s->unk_id = found->second;
            }
            Json null;
            auto component = [&](const char* key) -> const Json& {
                const Json* value = json.find(key);
                return value ? *value : null;
            };
            read.normalizers(component("normalizer"), s->normalizers);
            read.pre_tokenizers(component("pre_tokenizer"), s->pre_tokenizers);
            read.post_processor(component("post_processor"), *s);
            read.decoders(component("decoder"), s->decoders);
        } catch (const Error& e) {
            std::string message = e.what();
            if (message.rfind(file, 0) == 0) throw;
            fail(file, ": ", message);
        }

        if (config) {
            s->bos_token = config_token(*config, "bos_token");
            s->eos_token = config_token(*config, "eos_token");
            s->add_bos = Reader::flag(*config, "add_bos_token", false);
            s->add_eos = Reader::flag(*config, "add_eos_token", false);
            if (const Json* chat = config->find("chat_template")) {
                if (chat->is_string()) {
                    s->chat_template = chat->as_string();
                } else if (chat->is_array()) {  // named templates: take "default"
                    for (const Json& named : chat->as_array())
                        if (const Json* name = named.find("name"); name && name->is_string() && name->as_string() == "default")
                            s->chat_template = named.at("template").as_string();
                }
            }
            auto id_of = [&](const std::string& token) {
                auto found = s->token_to_id.find(token);
                return token.empty() || found == s->token_to_id.end() ? -1 : found->second;
            };
            s->bos_id = id_of(s->bos_token);
            if (int eos = id_of(s->eos_token); eos >= 0) s->eos_ids.push_back(eos);
        }
        return wrap(std::move(s));
    }
};

}  // namespace detail

inline Tokenizer tokenizer_from_vocabulary(const Vocabulary& vocab, int bos_id, std::vector<int> eos_ids, std::string source) {
    return detail::TokenizerBuilder::from_vocabulary(vocab, bos_id, std::move(eos_ids), std::move(source));
}

inline Tokenizer load_tokenizer(const std::filesystem::path& path) {
    if (!std::filesystem::exists(path)) fail(path.string(), ": no such file or folder");
    std::filesystem::path json_path;
    if (std::filesystem::is_directory(path)) {
        json_path = path / "tokenizer.json";
        if (!std::filesystem::exists(json_path))
            fail(path.string(), ": no tokenizer.json in the folder (a Hugging Face tokenizer is needed to encode text)");
    } else if (detail::ends_with(path.string(), ".json")) {
        json_path = path;
    }
    if (!json_path.empty()) {
        Json json = Json::parse(read_text_file(json_path), json_path.string());
        std::optional<Json> config;
        auto config_path = json_path.parent_path() / "tokenizer_config.json";
        if (std::filesystem::exists(config_path)) config = Json::parse(read_text_file(config_path), config_path.string());
        return detail::TokenizerBuilder::from_hugging_face(json, config ? &*config : nullptr, json_path.string());
    }
    char magic[4] = {};
    std::ifstream(path, std::ios::binary).read(magic, 4);
    if (std::memcmp(magic, "GGUF", 4) == 0) {
        GgufFile gguf = read_gguf(path);
        Vocabulary vocab = detail::vocabulary_from_gguf(gguf);
        if (vocab.empty()) fail(path.string(), ": no tokenizer vocabulary in the GGUF metadata (tokenizer.ggml.model \"", vocab.model_name, "\")");
        std::vector<int> eos;
        if (gguf.find("tokenizer.ggml.eos_token_id")) eos.push_back(static_cast<int>(gguf.integer("tokenizer.ggml.eos_token_id")));
        if (gguf.find("tokenizer.ggml.eot_token_id")) {
            int eot = static_cast<int>(gguf.integer("tokenizer.ggml.eot_token_id"));
            if (std::find(eos.begin(), eos.end(), eot) == eos.end()) eos.push_back(eot);
        }
        return detail::TokenizerBuilder::from_vocabulary(vocab, static_cast<int>(gguf.integer_or("tokenizer.ggml.bos_token_id", -1)),
                                                          std::move(eos), path.string());
    }
    // llama2.c's tokenizer.bin: entries until the end of the file; BOS is 1 and EOS 2 in every such file.
    return detail::TokenizerBuilder::from_vocabulary(load_llama2c_tokenizer(path, -1), 1, {2}, path.string());
}

// ---- Vocabularies in model files ------------------------------------------------------------------------------------

// vocab_size < 0 reads entries until the end of the file (the file itself does not say how many it holds).
inline Vocabulary load_llama2c_tokenizer(const std::filesystem::path& path, int vocab_size) {
    MappedFile file(path);
    detail::ByteReader in(file, "llama2.c tokenizer");  // the same bounds-checked little-endian reads
    Vocabulary vocab;
    in.read<uint32_t>();           // max_token_length: not needed
    for (int id = 0; vocab_size < 0 ? in.position() < file.size() : id < vocab_size; ++id) {
        float score = in.read<float>();
        int32_t length = in.read<int32_t>();
        if (length < 0) fail(path.string(), ": token ", id, " has negative length ", length);
        in.need(static_cast<uint64_t>(length), "a token");
        std::string piece(reinterpret_cast<const char*>(file.data() + in.position()), static_cast<size_t>(length));
        in.seek(in.position() + static_cast<size_t>(length));
        // The file stores "▁" as a space and BOS/EOS as "\n<s>\n" / "\n</s>\n": restore SentencePiece's spelling.
        auto type = Vocabulary::Type::Normal;
        if (id == 0) type = Vocabulary::Type::Unknown;
        else if (id == 1 || id == 2) {
            type = Vocabulary::Type::Control;
            piece.erase(std::remove(piece.begin(), piece.end(), '\n'), piece.end());
        } else if (detail::byte_token_value(piece) >= 0) {
            type = Vocabulary::Type::Byte;
        } else {
            std::string restored;
            for (char ch : piece) restored += ch == ' ' ? std::string("\xE2\x96\x81") : std::string(1, ch);
            piece = restored;
        }
        vocab.pieces.push_back(piece);
        vocab.scores.push_back(score);
        vocab.types.push_back(type);
    }
    return vocab;
}

namespace detail {

inline Vocabulary vocabulary_from_gguf(const GgufFile& gguf) {
    Vocabulary vocab;
    const std::string path = gguf.file->path();
    std::string kind = gguf.string_or("tokenizer.ggml.model", "");
    vocab.model_name = kind;
    vocab.model = kind == "llama" ? Vocabulary::Model::Scores
                : kind == "gpt2"  ? Vocabulary::Model::RankedMerges
                                  : Vocabulary::Model::Unsupported;
    if (vocab.model == Vocabulary::Model::Unsupported) return vocab;  // none, or one we cannot read ("bert"): ids work
    const auto* tokens = gguf.array<std::string>("tokenizer.ggml.tokens");
    if (!tokens) fail(path, ": missing GGUF metadata tokenizer.ggml.tokens");
    vocab.pieces = *tokens;
    if (const auto* scores = gguf.array<double>("tokenizer.ggml.scores")) {
        if (scores->size() != tokens->size()) fail(path, ": tokenizer.ggml.scores has ", scores->size(), " entries for ", tokens->size(), " tokens");
        vocab.scores.assign(scores->begin(), scores->end());
    } else {
        vocab.scores.assign(tokens->size(), 0.0f);
    }
    vocab.types.assign(tokens->size(), Vocabulary::Type::Normal);
    if (const auto* types = gguf.array<int64_t>("tokenizer.ggml.token_type")) {
        if (types->size() != tokens->size()) fail(path, ": tokenizer.ggml.token_type has ", types->size(), " entries for ", tokens->size(), " tokens");
        for (size_t i = 0; i < types->size(); ++i) {
            int64_t type = (*types)[i];  // llama.cpp's token types: 0 undefined (a normal token), 1-6 as Vocabulary::Type
            if (type < 0 || type > 6)
                fail(path, ": tokenizer.ggml.token_type of token ", i, " is ", type, ", not a token type (0-6)");
            vocab.types[i] = type == 0 ? Vocabulary::Type::Normal : static_cast<Vocabulary::Type>(type);
        }
    }
    vocab.unk_id = static_cast<int>(gguf.integer_or("tokenizer.ggml.unknown_token_id", 0));
    vocab.add_bos = gguf.integer_or("tokenizer.ggml.add_bos_token", kind == "llama") != 0;
    vocab.add_eos = gguf.integer_or("tokenizer.ggml.add_eos_token", 0) != 0;
    vocab.add_space_prefix = gguf.integer_or("tokenizer.ggml.add_space_prefix", 1) != 0;
    vocab.chat_template = gguf.string_or("tokenizer.chat_template", "");
    if (kind == "gpt2") {
        const auto* merges = gguf.array<std::string>("tokenizer.ggml.merges");
        if (!merges) fail(path, ": missing GGUF metadata tokenizer.ggml.merges (needed by a \"gpt2\" vocabulary)");
        vocab.merges = *merges;
        vocab.pre = gguf.string_or("tokenizer.ggml.pre", "default");
    }
    return vocab;
}

// GGUF's tokenizer.* metadata for a vocabulary: what the reader above takes back.
inline std::map<std::string, GgufValue> gguf_vocabulary_metadata(const Vocabulary& vocab, int bos_id, const std::vector<int>& eos_ids) {
    std::map<std::string, GgufValue> metadata;
    if (vocab.empty()) return metadata;
    auto integer = [](int64_t value) { return GgufValue{value, U32, 0}; };
    auto flag = [](bool value) { return GgufValue{value, BOOL, 0}; };
    metadata["tokenizer.ggml.model"] = GgufValue{vocab.model_name, STRING, 0};
    metadata["tokenizer.ggml.tokens"] = GgufValue{vocab.pieces, ARRAY, STRING};
    std::vector<int64_t> types;
    for (Vocabulary::Type type : vocab.types) types.push_back(static_cast<int64_t>(type));
    metadata["tokenizer.ggml.token_type"] = GgufValue{types, ARRAY, I32};
    if (vocab.model == Vocabulary::Model::Scores) {
        metadata["tokenizer.ggml.scores"] = GgufValue{std::vector<double>(vocab.scores.begin(), vocab.scores.end()), ARRAY, F32};
        metadata["tokenizer.ggml.add_space_prefix"] = flag(vocab.add_space_prefix);
    } else {
        metadata["tokenizer.ggml.merges"] = GgufValue{vocab.merges, ARRAY, STRING};
        metadata["tokenizer.ggml.pre"] = GgufValue{vocab.pre, STRING, 0};
    }
    if (bos_id >= 0) metadata["tokenizer.ggml.bos_token_id"] = integer(bos_id);
    if (!eos_ids.empty()) metadata["tokenizer.ggml.eos_token_id"] = integer(eos_ids.front());
    if (eos_ids.size() > 1) metadata["tokenizer.ggml.eot_token_id"] = integer(eos_ids.back());  // Llama 3's <|eot_id|>
    if (vocab.unk_id >= 0 && static_cast<size_t>(vocab.unk_id) < vocab.types.size() &&
        vocab.types[static_cast<size_t>(vocab.unk_id)] == Vocabulary::Type::Unknown)
        metadata["tokenizer.ggml.unknown_token_id"] = integer(vocab.unk_id);
    metadata["tokenizer.ggml.add_bos_token"] = flag(vocab.add_bos);
    metadata["tokenizer.ggml.add_eos_token"] = flag(vocab.add_eos);
    if (!vocab.chat_template.empty()) metadata["tokenizer.chat_template"] = GgufValue{vocab.chat_template, STRING, 0};
    return metadata;
}

}  // namespace detail

// A Hugging Face folder's tokenizer.json (with the tokenizer_config.json beside it) as the vocabulary a GGUF file
// carries, for `infer quantize` from a folder. GGUF spells two kinds of BPE:
//   SentencePiece's (byte fallback, spaces as "▁": Llama 2, Mistral, TinyLlama) → "llama": pieces with scores.
//     SentencePiece merges the adjacent pair whose joined piece scores highest, tokenizer.json the pair whose merge
//     ranks first; scoring each piece minus the rank of the first merge that makes it has both pick the same pair.
//   byte-level (Llama 3, Qwen2/3, GPT-2) → "gpt2": tokens, merges in rank order, and the split regex under the name
//     llama.cpp gives it (tokenizer.ggml.pre: "llama-bpe", "qwen2", "gpt-2").
// A tokenizer GGUF cannot spell is refused by name; what llama.cpp's converter also leaves out (a normalizer such as
// Qwen's NFC, which matters only for text that is not already NFC) is said in `notes`.
struct ConvertedVocabulary {
    Vocabulary vocab;
    int bos_id = -1;
    std::vector<int> eos_ids;
    std::vector<std::string> notes;
};

inline ConvertedVocabulary vocabulary_from_tokenizer_json(const std::filesystem::path& folder) {
    const std::filesystem::path path = folder / "tokenizer.json";
    const std::string file = path.string();
    const Json json = Json::parse(read_text_file(path), file);
    std::optional<Json> config;
    if (const auto config_path = folder / "tokenizer_config.json"; std::filesystem::exists(config_path))
        config = Json::parse(read_text_file(config_path), config_path.string());
    auto type_of = [](const Json* component) {
        const Json* type = component ? component->find("type") : nullptr;
        return type && type->is_string() ? type->as_string() : std::string();
    };
    auto flag = [](const Json& object, std::string_view key, bool fallback) {
        const Json* value = object.find(key);
        return value && value->is_bool() ? value->as_bool() : fallback;
    };
    // A Sequence's parts, or the component alone.
    auto parts = [&](const Json* component, const char* list) {
        std::vector<const Json*> out;
        if (!component || component->is_null()) return out;
        if (const Json* items = component->find(list); items && items->is_array() && type_of(component) == "Sequence")
            for (const Json& item : items->as_array()) out.push_back(&item);
        else out.push_back(component);
        return out;
    };

    ConvertedVocabulary out;
    Vocabulary& v = out.vocab;
    const Json& model = json.at("model");
    if (const std::string type = type_of(&model); type != "BPE" && !(type.empty() && model.find("merges")))
        fail(file, ": model type \"", type, "\" has no GGUF spelling here (BPE only)");

    // Tokens by id: the vocabulary, then the added tokens (which may sit past it).
    std::vector<std::pair<std::string, int>> entries;
    for (const auto& [token, id] : model.at("vocab").as_object()) entries.emplace_back(token, static_cast<int>(id.as_int()));
    std::vector<std::pair<const Json*, int>> added;
    if (const Json* list = json.find("added_tokens"); list && list->is_array())
        for (const Json& token : list->as_array()) added.emplace_back(&token, static_cast<int>(token.at("id").as_int()));
    int largest = -1;
    for (const auto& [token, id] : entries) largest = std::max(largest, id);
    for (const auto& [token, id] : added) largest = std::max(largest, id);
    if (largest < 0 || largest >= (1 << 24)) fail(file, ": token ids run to ", largest, ", not a vocabulary");
    v.pieces.assign(static_cast<size_t>(largest) + 1, std::string());
    std::vector<char> present(v.pieces.size(), 0);
    for (const auto& [token, id] : entries) {
        if (id < 0) fail(file, ": vocab token \"", token, "\" has id ", id);
        v.pieces[static_cast<size_t>(id)] = token;
        present[static_cast<size_t>(id)] = 1;
    }
    v.types.assign(v.pieces.size(), Vocabulary::Type::Normal);
    for (const auto& [token, id] : added) {
        if (id < 0) fail(file, ": added token ", id, " has a negative id");
        v.pieces[static_cast<size_t>(id)] = token->at("content").as_string();
        present[static_cast<size_t>(id)] = 1;
        v.types[static_cast<size_t>(id)] = flag(*token, "special", false) ? Vocabulary::Type::Control : Vocabulary::Type::UserDefined;
    }
    for (size_t id = 0; id < present.size(); ++id)
        if (!present[id]) fail(file, ": token id ", id, " is in neither the vocabulary nor added_tokens");
    std::unordered_map<std::string, int> id_of;
    for (size_t id = 0; id < v.pieces.size(); ++id) id_of.emplace(v.pieces[id], static_cast<int>(id));
    v.unk_id = -1;
    if (const Json* unk = model.find("unk_token"); unk && unk->is_string()) {
        auto found = id_of.find(unk->as_string());
        if (found == id_of.end()) fail(file, ": unk_token \"", unk->as_string(), "\" is not in the vocabulary");
        v.unk_id = found->second;
        v.types[static_cast<size_t>(v.unk_id)] = Vocabulary::Type::Unknown;
    }
    std::vector<std::string> merges;
    for (const Json& merge : model.at("merges").as_array()) {
        if (merge.is_string()) {
            merges.push_back(merge.as_string());
        } else {
            const auto& pair = merge.as_array();
            if (pair.size() != 2) fail(file, ": merge ", merges.size(), " is not a pair");
            merges.push_back(pair[0].as_string() + " " + pair[1].as_string());
        }
    }

    const Json* normalizer = json.find("normalizer");
    const Json* pre_tokenizer = json.find("pre_tokenizer");
    if (flag(model, "byte_fallback", false)) {
        // SentencePiece-style: spaces become "▁" (a Replace normalizer or a Metaspace pre-tokenizer), "▁" in front.
        v.model = Vocabulary::Model::Scores;
        v.model_name = "llama";
        bool replaces_spaces = false, prepends = false;
        for (const Json* n : parts(normalizer, "normalizers")) {
            const std::string type = type_of(n);
            if (type == "Prepend") prepends = true;
            else if (type == "Replace") replaces_spaces = true;
            else fail(file, ": normalizer \"", type, "\" has no GGUF spelling (SentencePiece-style vocabularies: Prepend, Replace)");
        }
        for (const Json* p : parts(pre_tokenizer, "pretokenizers")) {
            if (type_of(p) != "Metaspace") fail(file, ": pre-tokenizer \"", type_of(p), "\" has no GGUF spelling with byte fallback");
            replaces_spaces = true;
            const Json* scheme = p->find("prepend_scheme");
            prepends = scheme && scheme->is_string() ? scheme->as_string() != "never" : flag(*p, "add_prefix_space", true);
        }
        if (!replaces_spaces) fail(file, ": a byte-fallback BPE that does not spell spaces as \"▁\" has no GGUF spelling");
        v.add_space_prefix = prepends;
        v.scores.assign(v.pieces.size(), 0.0f);
        std::vector<char> scored(v.pieces.size(), 0);
        for (size_t rank = 0; rank < merges.size(); ++rank) {
            const std::string& merge = merges[rank];
            const size_t space = merge.find(' ', 1);
            if (space == std::string::npos) fail(file, ": merge ", rank, " (\"", merge, "\") is not \"left right\"");
            auto found = id_of.find(merge.substr(0, space) + merge.substr(space + 1));
            if (found == id_of.end() || scored[static_cast<size_t>(found->second)]) continue;
            scored[static_cast<size_t>(found->second)] = 1;
            v.scores[static_cast<size_t>(found->second)] = -static_cast<float>(rank + 1);
        }
        for (size_t id = 0; id < v.pieces.size(); ++id)
            if (v.types[id] == Vocabulary::Type::Normal && detail::byte_token_value(v.pieces[id]) >= 0) v.types[id] = Vocabulary::Type::Byte;
    } else {
        // Byte-level: a ByteLevel pre-tokenizer, alone (GPT-2's regex) or after a Split whose regex GGUF names.
        v.model = Vocabulary::Model::RankedMerges;
        v.model_name = "gpt2";
        v.merges = std::move(merges);
        std::string split;
        bool byte_level = false, byte_level_regex = false;
        for (const Json* p : parts(pre_tokenizer, "pretokenizers")) {
            const std::string type = type_of(p);
            if (type == "Split") {
                const Json* regex = p->at("pattern").find("Regex");
                if (!regex || !regex->is_string()) fail(file, ": a Split pre-tokenizer without a regex has no GGUF spelling");
                split = regex->as_string();
            } else if (type == "ByteLevel") {
                byte_level = true;
                byte_level_regex = flag(*p, "use_regex", true);
            } else {
                fail(file, ": pre-tokenizer \"", type, "\" has no GGUF spelling");
            }
        }
        if (!byte_level) fail(file, ": a BPE without byte fallback or a ByteLevel pre-tokenizer has no GGUF spelling");
        if (split == detail::llama3_split_pattern && !byte_level_regex) v.pre = "llama-bpe";
        else if (split == detail::qwen2_split_pattern && !byte_level_regex) v.pre = "qwen2";
        else if (split.empty() && byte_level_regex) v.pre = "gpt-2";
        else fail(file, ": its split regex has no GGUF name (supported: the Llama 3, Qwen2 and GPT-2 splits)");
        for (const Json* n : parts(normalizer, "normalizers"))
            out.notes.push_back(file + ": normalizer \"" + type_of(n) + "\" is not stored (GGUF has no normalizer; "
                                "llama.cpp's converter leaves it out too)");
    }

    // BOS and EOS: tokenizer_config.json's tokens and add_bos_token; without the flag, a post-processor that starts
    // every sequence with a special token adds BOS.
    auto config_id = [&](std::string_view key) {
        const std::string token = config ? detail::TokenizerBuilder::config_token(*config, key) : "";
        auto found = id_of.find(token);
        return token.empty() || found == id_of.end() ? -1 : found->second;
    };
    out.bos_id = config_id("bos_token");
    if (int eos = config_id("eos_token"); eos >= 0) out.eos_ids.push_back(eos);
    bool template_bos = false;
    for (const Json* p : parts(json.find("post_processor"), "processors"))
        if (type_of(p) == "TemplateProcessing")
            if (const Json* single = p->find("single"); single && single->is_array() && !single->as_array().empty())
                if (const Json* first = single->as_array().front().find("SpecialToken")) {
                    template_bos = true;
                    if (out.bos_id < 0)
                        if (auto found = id_of.find(first->at("id").as_string()); found != id_of.end()) out.bos_id = found->second;
                }
    v.add_bos = config && config->find("add_bos_token") && config->find("add_bos_token")->is_bool()
                    ? config->find("add_bos_token")->as_bool()
                    : template_bos;
    v.add_eos = config ? flag(*config, "add_eos_token", false) : false;
    if (config)
        if (const Json* chat = config->find("chat_template"); chat && chat->is_string()) v.chat_template = chat->as_string();
    return out;
}

// ==== F CPU KERNELS ==================================================================================================
// How section 04's operations run fast on a CPU, giving the same bits as their portable definitions. First the choice
// of kernels (the widest SIMD path the CPU runs, chosen once from CPUID) and the bf16 products; then the matmul's
// tiles, the loop order that keeps a block of weight rows in L2 while tiles of tokens pass over it, the prefetch
// requests, and the dispatch by weight type; last the AVX2 and AVX-512 twins themselves. Each SIMD kernel is compiled
// for its instruction set through a target attribute, whatever flags the program is built with, and runs only where
// cpu_supports() says the CPU has it; helpers that use intrinsics carry the same attribute (a lambda would not
// inherit it, so there are none here). The float tiles keep the portable kernel's sixteen lanes per sum (AVX-512: one
// register; AVX2: two of eight) and fold them in its tree, so every path gives the same bits. bf16 and f16 weights
// are widened in registers. Chapter 07 teaches why these choices matter: the roofline of each pass.

// ---- Which SIMD kernels run -----------------------------------------------------------------------------------------
// One binary is fast on every x86-64 machine: the matmul and attention kernels exist as a portable loop and as AVX2
// (with FMA and F16C) and AVX-512 versions compiled through target attributes (appendix F), and the widest the CPU
// supports is chosen once, at first use, from CPUID. All three build every sum in the same order out of fused
// multiply-adds, so they give identical logits. INFER_KERNELS=portable|avx2|avx512 in the environment, or
// use_cpu_kernels(), picks one by hand (the tests compare them on the machine's paths).

inline const char* cpu_kernels_name(CpuKernels kernels) {
    switch (kernels) {
        case CpuKernels::Avx2: return "avx2";
        case CpuKernels::Avx512: return "avx512";
        default: return "portable";
    }
}

// Whether this CPU (and its operating system, which must save the wider registers) runs a path.
inline bool cpu_supports(CpuKernels kernels) {
#ifdef INFER_X86_KERNELS
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");  // every AVX2 CPU has F16C
    switch (kernels) {
        case CpuKernels::Portable: return true;
        case CpuKernels::Avx2: return avx2;
        case CpuKernels::Avx512:
            return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl");
    }
    return false;
#else
    return kernels == CpuKernels::Portable;
#endif
}

inline CpuKernels best_cpu_kernels() {
    for (CpuKernels kernels : {CpuKernels::Avx512, CpuKernels::Avx2})
        if (cpu_supports(kernels)) return kernels;
    return CpuKernels::Portable;
}

inline CpuKernels parse_cpu_kernels(std::string_view name, std::string_view where) {
    for (CpuKernels kernels : {CpuKernels::Portable, CpuKernels::Avx2, CpuKernels::Avx512})
        if (name == cpu_kernels_name(kernels)) {
            if (!cpu_supports(kernels)) fail(where, ": this CPU cannot run the ", name, " kernels (best: ", cpu_kernels_name(best_cpu_kernels()), ")");
            return kernels;
        }
    fail(where, ": unknown kernels \"", name, "\" (portable, avx2 or avx512)");
}

namespace detail {
inline std::atomic<int>& kernel_choice() {
    static std::atomic<int> choice{-1};  // -1: not chosen yet
    return choice;
}
}  // namespace detail

// The path in use: INFER_KERNELS if set, else the best the CPU runs. Read by every matmul; cheap after the first call.
inline CpuKernels cpu_kernels() {
    int choice = detail::kernel_choice().load(std::memory_order_relaxed);
    if (choice < 0) {
        const char* asked = std::getenv("INFER_KERNELS");
        CpuKernels kernels = asked && *asked ? parse_cpu_kernels(asked, "INFER_KERNELS") : best_cpu_kernels();
        choice = static_cast<int>(kernels);
        detail::kernel_choice().store(choice, std::memory_order_relaxed);
    }
    return static_cast<CpuKernels>(choice);
}

// Switches every later matmul to `kernels` (fails if the CPU cannot run them). Not while a forward pass runs.
inline void use_cpu_kernels(CpuKernels kernels) {
    if (!cpu_supports(kernels)) fail("this CPU cannot run the ", cpu_kernels_name(kernels), " kernels");
    detail::kernel_choice().store(static_cast<int>(kernels), std::memory_order_relaxed);
}

// bf16 × bf16 products (opt-in): llama.cpp's arithmetic for bf16 weights.
// llama.cpp multiplies bf16 weights by activations rounded to bf16, with AVX512_BF16's vdpbf16ps: 32 products per
// instruction where widening the weights to f32 gives 16, and no widening. use_bf16_activations(true) (or
// INFER_BF16_ACTIVATIONS=1, or infer's --bf16-activations) does the same for every BF16 matrix: prefill's arithmetic
// halves where the CPU has AVX512_BF16. The cost is precision: each activation keeps 8 of its 24 significant bits,
// so logits move by a few thousandths (chapter 07 has the figures); off by default, where bf16 weights meet f32
// activations and the logits match the reference engines' to 1e-4. The sums are defined so that a portable loop
// gives vdpbf16ps's bits:
//   - each activation rounded to bf16 (nearest, ties to even), a subnormal one to zero;
//   - 16 lanes per sum: in each block of 32 columns, lane j adds the product of column 2j + 1, then that of column 2j,
//     each step one rounding of the exact product (8 × 8 significant bits fit a float) added to the lane, that is a
//     fused multiply-add, a subnormal result flushed to zero and a subnormal weight read as zero;
//   - fold_lanes's tree, then the last K % 32 columns in order (plain fused multiply-adds).
// So batch invariance and the identical logits of every path hold in this mode too.

namespace detail {
inline std::atomic<bool>& bf16_activation_choice() {
    static std::atomic<bool> choice{[] {
        const std::string_view asked = std::getenv("INFER_BF16_ACTIVATIONS") ? std::getenv("INFER_BF16_ACTIVATIONS") : "";
        if (asked != "" && asked != "0" && asked != "1") fail("INFER_BF16_ACTIVATIONS: \"", asked, "\" is not 0 or 1");
        return asked == "1";
    }()};
    return choice;
}
}  // namespace detail

inline bool bf16_activations() { return detail::bf16_activation_choice().load(std::memory_order_relaxed); }
// Switches every later matmul of BF16 weights to (or back from) the bf16 products. Not while a forward pass runs.
inline void use_bf16_activations(bool on) { detail::bf16_activation_choice().store(on, std::memory_order_relaxed); }

namespace detail {

// What a full AVX-512 tile asks the memory system for while it computes (a hint: no effect on any result). The tile
// reads three rows at once, interleaved streams the hardware prefetchers follow too late, so it asks itself, in one of
// two ways (for_each_block_and_tile below decides which):
// - own_rows: in each of its R rows, the line tile_prefetch_bytes<C> / R ahead of the one it reads, into L1, and past
//   the row's end that far into the same row of the next R (the rows are adjacent, so the requests cover the matrix,
//   across the block's end into the next). This is the first tile over a block, which reads the block from memory
//   unless earlier tiles asked for it; without the requests it waits on its loads. The lead is counted along each row
//   because the R rows are read side by side: a single distance in addresses lands in the next rows of the same R,
//   read at the same moment, and leaves some of the R rows no lead at all.
// - [begin, begin + bytes): a share of the next block, into L2. These are the full tiles over a block that the
//   tiles over the block before asked for, which find it in L2 and bring in the next while they compute: the later
//   tiles, and the first too where a block has two full tiles or more (16 tokens on; a lone full tile asks for its
//   own rows). They ask into L2 rather than for their own rows because lines pulled into L1 evict the tile's
//   activations. A tile asks in one step out of 2^pace, R lines at a time, so that its share comes in over most of its
//   run rather than in a burst at its start: with 15 tiles sharing a block (128 tokens) a share is a fifteenth of the
//   lines the tile reads, and asked for all at once they arrive too late (a lone sharing tile asks in every step).
//   Only the last of those tiles share the next block, as many as bring at most next_block_activation_bytes of
//   activations after the first of them (below).
// The smaller tiles one row at a time read a stream the hardware keeps up with, and ask for nothing; four or two
// tokens three rows at a time (16-bit rows, and f32 rows past one_row_activation_bytes) ask for their own rows as a
// first full tile does; after another tile (rows_cached) the block is in L2.
struct Prefetch {
    bool own_rows = false;
    const std::byte* begin = nullptr;
    size_t bytes = 0;
    bool rows_cached = false;  // another tile has just passed over these rows
    unsigned pace = 0;  // a share's tile asks in one step out of 2^pace
};

// The activations that pass through L2 between the first request for the next block and the end of this one: the tiles
// that share the next block are the last ones over this block whose activations come to this much, and at least four.
// Asked for earlier, the next block's rows wait in L2 while every later tile's activations come through it (with 128
// tokens of 2048 f32 columns, 1 MB of them per block), and some are gone before their turn.
constexpr size_t next_block_activation_bytes = size_t{256} << 10;
constexpr int fewest_sharing_tiles = 4;

// How far ahead of its reads a tile of C tokens asks for its own rows, its R rows together (each row a share of it,
// along itself): the lines waiting in L1 beside the activations. 8 KB for 8 tokens, twice that for 4 and four times
// for 2, whose smaller activations leave the lines more room in L1.
template <int C>
constexpr size_t tile_prefetch_bytes = (size_t{64} << 10) / C;

// A tile's activations that stay in L1 while rows pass under it (L1 holds 32 to 48 KB on CPUs with AVX-512, and the
// rows pass through it too). Past that (8 tokens of more than 1024 columns: every matrix of a 2048-wide model) a
// tile whose rows are in L2 reads them in column panels that fit, over a chunk of rows at a time, the chunk's sums
// kept in memory from one panel to the next: each lane still adds its columns in order, so the bits are the same,
// while the activations come from L2 once per chunk instead of once per three rows.
constexpr size_t tile_activation_bytes = size_t{32} << 10;

// The activations that a tile one row at a time keeps in L1: it reads all of them again for every row, while the
// weights stream through L1 beside them, so only about a third of L1. Past that, 4 or 2 tokens of f32 rows go three
// rows at a time as 16-bit rows always do, each activation loaded serving three rows. Up to it, one row at a time keeps
// the single sequential stream that the hardware prefetchers follow best (tile_tokens below).
constexpr size_t one_row_activation_bytes = size_t{16} << 10;

// The activations of one pass of AVX2's three-row tile (four tokens or two, three_row_tile_avx2) that stay in L1: half
// of the 32 KB that many AVX2 CPUs have. Past it (four tokens of more than 1024 columns) the passes that find their
// rows in L2 read them in column panels, as tile_activation_bytes has AVX-512's tiles do.
constexpr size_t pass_activation_bytes = size_t{16} << 10;

#ifdef INFER_X86_KERNELS
// (Declarations repeat the definitions' target attributes: with other attributes they would name other functions.)
template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] void tile_avx2(const std::byte* weights, size_t row_bytes, size_t rows, const float* x,
                                                 size_t K, float* out, size_t N);
template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] void three_row_tile_avx2(const std::byte* weights, size_t row_bytes, size_t rows,
                                                           const float* x, size_t K, float* out, size_t N, Prefetch ahead);
template <DType dtype, int C>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] void tile_avx512(const std::byte* weights, size_t row_bytes,
                                                                             size_t rows, const float* x, size_t K, float* out,
                                                                             size_t N, Prefetch ahead);
#endif

// Tokens per tile: as many sums as the registers hold beside the weights and the activation being multiplied. An
// AVX-512 sum is one register of sixteen lanes (32 registers: 8 tokens × 3 rows); an AVX2 sum two of eight, or one
// while its halves go in turn (16 registers: 4 tokens × 3 rows, a full tile in two passes). Below a full tile of tokens
// the rows go one at a time, in memory order: at decode the matrix is then one sequential stream, which the hardware
// prefetchers follow best, where several rows read side by side are interleaved streams they follow too late. Two
// exceptions, where the arithmetic is the limit rather than the stream, take AVX-512 three rows at a time too: the
// tokens after the first tile over a block (a batch of 9 to 15, a prompt's last few, the 2 and 1 after a 4), whose rows
// that tile has just brought into L2; and 4 or 2 tokens of 16-bit weights, whose bytes carry twice the arithmetic of
// f32's, or of f32 weights whose activations outgrow L1 one row at a time (one_row_activation_bytes).
constexpr int tile_tokens = 8;
// Weight rows of a full AVX-512 tile, taken together: 3 × 8 sums + 3 weights + 1 activation of the 32 registers.
constexpr int tile_rows = 3;

// C tokens against the rows [row_begin, row_end) of a block, in the path's kernel for a tile of C. The first full
// tile over a block of 16-bit rows goes as two tiles of C / 2 where that lets its activations stay in L1 (more than
// 1024 columns, at most 2048): the first half asks for its own rows from memory, the second finds them in L2. Kept
// whole, that tile would read all its activations from L2 at every step, each read holding one of L1's few miss
// buffers, which the requests for the rows need too, and move the rows at half the rate of 4 tokens over them. Wider
// rows, where 4 tokens overflow L1 too, are slower split and stay whole; f32 rows gain nothing from it and stay whole.
// AVX2's full tile goes three rows at a time as well, its 8 tokens in two passes of 4 (three_row_tile_avx2), each
// sum's two halves in turn (rows_avx2_by_halves), rather than three passes of 2: each weight loaded then serves four
// tokens instead of two. For the same reason AVX2's tiles of 4 and 2 follow AVX-512's rule, 4 tokens in one pass
// instead of two passes of 2.
template <CpuKernels path, DType dtype, int C>
inline void token_tile(const std::byte* weights, size_t row_bytes, const float* x, size_t K, float* out, size_t N,
                       size_t row_begin, size_t row_end, Prefetch ahead) {
    weights += row_begin * row_bytes;
    out += row_begin;
    const size_t rows = row_end - row_begin;
#ifdef INFER_X86_KERNELS
    // AVX-512 where the arithmetic is the limit (tile_tokens above says where). Otherwise the first tile over a block
    // below a full one is bound by the weights' bytes: one row at a time (one stream), in AVX2, whose two halves per
    // sum give one row twice the independent FMA chains an AVX-512 register would (same bits either way). On an AVX2
    // CPU the same tiles go three rows at a time, in passes of four tokens or two (above).
    if constexpr (path == CpuKernels::Avx512) {
        if constexpr (C == tile_tokens && dtype != DType::F32)
            if (ahead.own_rows && C * K * 4 > tile_activation_bytes && C / 2 * K * 4 <= tile_activation_bytes) {
                // The first tile over a block, in halves whose activations fit in L1 (above).
                tile_avx512<dtype, C / 2>(weights, row_bytes, rows, x, K, out, N, Prefetch{.own_rows = true});
                return tile_avx512<dtype, C / 2>(weights, row_bytes, rows, x + C / 2 * K, K, out + C / 2 * N, N,
                                                 Prefetch{.rows_cached = true});
            }
        if (C == tile_tokens || ahead.rows_cached) return tile_avx512<dtype, C>(weights, row_bytes, rows, x, K, out, N, ahead);
        if constexpr (C == 4 || C == 2)  // the first over its block: its rows from memory
            if (dtype != DType::F32 || C * K * 4 > one_row_activation_bytes)
                return tile_avx512<dtype, C>(weights, row_bytes, rows, x, K, out, N, Prefetch{.own_rows = true});
    }
    if constexpr (path == CpuKernels::Avx2) {
        if constexpr (C == tile_tokens) return three_row_tile_avx2<dtype, C>(weights, row_bytes, rows, x, K, out, N, ahead);
        if constexpr (C == 4 || C == 2)  // as AVX-512's tiles of 4 and 2 above
            if (ahead.rows_cached || dtype != DType::F32 || C * K * 4 > one_row_activation_bytes)
                return three_row_tile_avx2<dtype, C>(weights, row_bytes, rows, x, K, out, N,
                                                     Prefetch{.own_rows = !ahead.rows_cached});
    }
    // (A full tile never reaches here on a SIMD path: each returned above.)
    if constexpr (path != CpuKernels::Portable && C != tile_tokens)
        return tile_avx2<dtype, C>(weights, row_bytes, rows, x, K, out, N);
#endif
    (void)ahead;
    tile_portable<dtype, C>(weights, row_bytes, rows, x, K, out, N);
}

// The loop order of every matmul kernel (why: dot_rows below): the rows in blocks of about 256 KB, and over each
// block the tokens in tiles of C, then of 4, 2 and 1 for the rest. tile(std::integral_constant<int, tokens>, first
// token, block's first row, block's end, ahead) computes one tile against one block; `ahead` is what it asks for
// (Prefetch above): the last full tiles an even share each of the next block, the first its own rows instead over the
// first block and where it is alone; the smaller tiles nothing (and whether another tile went over the block before
// them).
template <int C, class Tile>
inline void for_each_block_and_tile(const std::byte* weights, size_t row_bytes, size_t token_bytes, int T,
                                    size_t row_begin, size_t row_end, Tile tile) {
    // About 256 KB, rounded to whole groups of three rows, the full tile's: otherwise the rows left over go to the
    // one-row kernel (from a block of 11 rows, two), whose eight sums load an activation per multiply-add.
    const size_t fit = std::max<size_t>(1, (size_t{256} << 10) / row_bytes);
    const size_t rows_per_block = fit >= tile_rows ? (fit + tile_rows / 2) / tile_rows * tile_rows : fit;
    const int full_tiles = T / C;
    const int late_tiles = std::max(fewest_sharing_tiles, static_cast<int>(next_block_activation_bytes / (C * token_bytes)));
    for (size_t block = row_begin; block < row_end; block += rows_per_block) {
        const size_t block_end = std::min(row_end, block + rows_per_block);
        const std::byte* next = weights + block_end * row_bytes;
        const size_t next_bytes = (std::min(row_end, block_end + rows_per_block) - block_end) * row_bytes;
        // The first full tile asks for its own rows over the first block (no block before asked for it) and where it
        // is the only full tile; otherwise the full tiles find the block in L2, and the last of them (late_tiles,
        // next_block_activation_bytes) take a share each of the next.
        const int asking_own = block == row_begin || full_tiles < 2 ? 1 : 0;  // tiles that ask for their own rows
        const int sharing_tiles = std::min(full_tiles - asking_own, late_tiles);
        const int first_sharing = full_tiles - sharing_tiles;  // the full tiles between ask for nothing
        // 2^pace the largest power of two up to sharing_tiles: a tile's share then takes half to all of its run.
        const unsigned pace = sharing_tiles > 0 ? std::bit_width(static_cast<unsigned>(sharing_tiles)) - 1 : 0;
        const auto ahead = [&](int full_tile) {
            if (full_tile < asking_own) return Prefetch{true};
            if (full_tile < first_sharing) return Prefetch{};
            const int share = full_tile - first_sharing;
            const size_t begin = next_bytes * share / sharing_tiles, end = next_bytes * (share + 1) / sharing_tiles;
            return Prefetch{.begin = next + begin, .bytes = end - begin, .pace = pace};
        };
        int t = 0;
        for (; t + C <= T; t += C) tile(std::integral_constant<int, C>{}, t, block, block_end, ahead(t / C));
        for (; t + 4 <= T; t += 4) tile(std::integral_constant<int, 4>{}, t, block, block_end, Prefetch{.rows_cached = t > 0});
        for (; t + 2 <= T; t += 2) tile(std::integral_constant<int, 2>{}, t, block, block_end, Prefetch{.rows_cached = t > 0});
        if (t < T) tile(std::integral_constant<int, 1>{}, t, block, block_end, Prefetch{.rows_cached = t > 0});
    }
}

// Rows [row_begin, row_end) of out[T, N] = x[T, K] · w[N, K]ᵀ, one thread's share; w's rows are row_bytes apart.
// The rows go in blocks of about 256 KB, which stay in L2 while every tile of C tokens passes over them; a tile's
// activations (C × K floats, or a panel of their columns: tile_activation_bytes) stay in L1 while the block's rows
// pass under it. So each weight byte comes from memory once per call, whatever T is (at decode, T = 1, the weights
// simply stream), and each weight loaded into a register serves C tokens. Attention uses it too, with cached keys as
// the rows.
template <CpuKernels path, DType dtype>
inline void dot_rows(const std::byte* weights, size_t row_bytes, size_t K, size_t N, const float* x, int T, float* out,
                     size_t row_begin, size_t row_end) {
    const auto tile = [&](auto tokens, int t, size_t block, size_t block_end, Prefetch ahead) {
        token_tile<path, dtype, tokens.value>(weights, row_bytes, x + t * K, K, out + t * N, N, block, block_end, ahead);
    };
    for_each_block_and_tile<tile_tokens>(weights, row_bytes, K * 4, T, row_begin, row_end, tile);
}

template <DType dtype>
inline void matmul_rows(CpuKernels path, const std::byte* weights, size_t K, size_t N, const float* x, int T, float* out,
                        size_t row_begin, size_t row_end) {
    const size_t row_bytes = static_cast<size_t>(dtype_bytes(dtype, static_cast<int64_t>(K)));
    switch (path) {
        case CpuKernels::Avx512: return dot_rows<CpuKernels::Avx512, dtype>(weights, row_bytes, K, N, x, T, out, row_begin, row_end);
        case CpuKernels::Avx2: return dot_rows<CpuKernels::Avx2, dtype>(weights, row_bytes, K, N, x, T, out, row_begin, row_end);
        default: return dot_rows<CpuKernels::Portable, dtype>(weights, row_bytes, K, N, x, T, out, row_begin, row_end);
    }
}

// The bf16 products' kernel (their definition: use_bf16_activations above).
inline float flush_subnormal(float value) {
    return std::fabs(value) < std::numeric_limits<float>::min() ? std::copysign(0.0f, value) : value;
}
inline uint16_t bf16_bits_at(const std::byte* row, size_t k) {
    uint16_t half;
    std::memcpy(&half, row + k * 2, 2);
    return half;
}
// A bf16 value with a zero exponent (zero or subnormal) becomes a zero of its sign, as vdpbf16ps reads its inputs.
inline uint16_t bf16_flush_subnormal(uint16_t half) { return (half & 0x7F80) == 0 ? half & 0x8000 : half; }
inline float bf16_flushed(uint16_t half) { return bf16_to_f32(bf16_flush_subnormal(half)); }

// x[T, K] rounded to bf16, subnormals to zero: the activations of the bf16 products, once per matmul call.
inline void round_activations_to_bf16(const float* x, size_t count, uint16_t* out) {
    for (size_t i = 0; i < count; ++i) out[i] = bf16_flush_subnormal(f32_to_bf16(x[i]));
}

// The last K % 32 columns of a bf16 product, in order, added to the folded sum.
inline float finish_bf16_dot(const std::byte* row, const uint16_t* x, size_t K32, size_t K, float sum) {
    for (size_t k = K32; k < K; ++k) sum = std::fma(weight_at<DType::BF16>(row, k), bf16_to_f32(x[k]), sum);
    return sum;
}

// The definition above, one row at a time against C tokens (the portable kernel; appendix F has the AVX512_BF16 one).
template <int C>
inline void bf16_tile_portable(const std::byte* weights, size_t row_bytes, size_t rows, const uint16_t* x, size_t K,
                               float* out, size_t N) {
    const size_t K32 = K / 32 * 32;
    for (size_t n = 0; n < rows; ++n) {
        const std::byte* row = weights + n * row_bytes;
        float lanes[C][16] = {};
        for (size_t k = 0; k < K32; k += 32)
            for (int lane = 0; lane < 16; ++lane) {
                const size_t even = k + 2 * static_cast<size_t>(lane);
                const float w_odd = bf16_flushed(bf16_bits_at(row, even + 1)), w_even = bf16_flushed(bf16_bits_at(row, even));
                for (int c = 0; c < C; ++c) {
                    const uint16_t* xc = x + c * K;
                    float sum = flush_subnormal(std::fma(w_odd, bf16_to_f32(xc[even + 1]), lanes[c][lane]));
                    lanes[c][lane] = flush_subnormal(std::fma(w_even, bf16_to_f32(xc[even]), sum));
                }
            }
        for (int c = 0; c < C; ++c) out[c * N + n] = finish_bf16_dot(row, x + c * K, K32, K, fold_lanes(lanes[c]));
    }
}

#ifdef INFER_X86_KERNELS
inline bool cpu_runs_bf16_avx512();  // whether the CPU has AVX512_BF16 (appendix F)
template <int C>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]] void bf16_tile_avx512(const std::byte* weights,
                                                                                            size_t row_bytes, size_t rows,
                                                                                            const uint16_t* x, size_t K,
                                                                                            float* out, size_t N,
                                                                                            Prefetch ahead);
#else
inline bool cpu_runs_bf16_avx512() { return false; }
#endif

template <int C>
inline void bf16_token_tile(bool avx512, const std::byte* weights, size_t row_bytes, const uint16_t* x, size_t K,
                            float* out, size_t N, size_t row_begin, size_t row_end, Prefetch ahead) {
    weights += row_begin * row_bytes;
    out += row_begin;
#ifdef INFER_X86_KERNELS
    if (avx512) return bf16_tile_avx512<C>(weights, row_bytes, row_end - row_begin, x, K, out, N, ahead);
#endif
    (void)avx512, (void)ahead;
    bf16_tile_portable<C>(weights, row_bytes, row_end - row_begin, x, K, out, N);
}

// Rows [row_begin, row_end) of out[T, N] = x[T, K] · w[N, K]ᵀ with x already rounded: dot_rows's blocking and tiles
// (8 tokens, then 4, 2, 1). The AVX-512 kernel where the path is AVX-512 and the CPU has AVX512_BF16; the portable
// loop elsewhere (the same bits, slower).
inline void matmul_rows_bf16(CpuKernels path, const std::byte* weights, size_t K, size_t N, const uint16_t* x, int T,
                             float* out, size_t row_begin, size_t row_end) {
    const bool avx512 = path == CpuKernels::Avx512 && cpu_runs_bf16_avx512();
    const size_t row_bytes = K * 2;
    const auto tile = [&](auto tokens, int t, size_t block, size_t block_end, Prefetch ahead) {
        bf16_token_tile<tokens.value>(avx512, weights, row_bytes, x + t * K, K, out + t * N, N, block, block_end, ahead);
    };
    for_each_block_and_tile<8>(weights, row_bytes, K * 2, T, row_begin, row_end, tile);
}

// Asks the memory system for `bytes` bytes ahead of their use (a hint: no effect on any result).
inline void prefetch_bytes(const std::byte* data, size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(data + i);
#else
    (void)data, (void)bytes;
#endif
}

#ifdef INFER_X86_KERNELS
[[gnu::target("avx2,fma,f16c")]] inline float softmax_exp_rows_avx2(float* s, int count, float max);  // appendix F
#endif

// A chunk's weights for one query from its scores s[0, count) and their maximum; returns the weights' sum.
template <CpuKernels path>
inline float softmax_exp_rows(float* s, int count, float max) {
#ifdef INFER_X86_KERNELS
    if constexpr (path != CpuKernels::Portable) return softmax_exp_rows_avx2(s, count, max);
#endif
    float partial[8] = {};
    return softmax_exp_rows_from(s, 0, count, max, partial);
}

// Attention's scores: out[c·N + j] = dot(cached row j, x + c·K) for the `count` rows at `rows` (K values each, in the
// cache's type, side by side), the tile kernel's sums on every path.
template <CpuKernels path>
inline void dot_cached_rows(DType dtype, const std::byte* rows, size_t K, size_t N, const float* x, int T, float* out,
                            size_t count) {
    const size_t row_bytes = static_cast<size_t>(dtype_bytes(dtype, static_cast<int64_t>(K)));
    switch (dtype) {
        case DType::F16: return dot_rows<path, DType::F16>(rows, row_bytes, K, N, x, T, out, 0, count);
        case DType::BF16: return dot_rows<path, DType::BF16>(rows, row_bytes, K, N, x, T, out, 0, count);
        default: return dot_rows<path, DType::F32>(rows, row_bytes, K, N, x, T, out, 0, count);
    }
}

#ifdef INFER_X86_KERNELS
template <DType dtype>
[[gnu::target("avx2,fma,f16c")]] inline void add_weighted_rows_avx2(float* acc, const std::byte* rows, const float* weights,
                                                                     int count, size_t n);  // appendix F
#endif

#ifdef INFER_X86_KERNELS
template <DType dtype>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] inline void add_weighted_rows4_avx512(
    float* acc, size_t acc_stride, const std::byte* rows, const float* weights, size_t weights_stride, int count,
    size_t n);  // appendix F
#endif

// The same for `queries` query rows over the same values: query q's sums at acc + q·acc_stride, its weights at
// weights + q·weights_stride. AVX-512 takes four at a time, so each value loaded serves four queries; elsewhere it is
// one query after the other. Per element the sum is the same chain either way.
template <CpuKernels path, DType dtype>
inline void add_weighted_rows_with(int queries, float* acc, size_t acc_stride, const std::byte* rows, const float* weights,
                                   size_t weights_stride, int count, size_t n) {
#ifdef INFER_X86_KERNELS
    if constexpr (path == CpuKernels::Avx512)
        if (queries == 4) return add_weighted_rows4_avx512<dtype>(acc, acc_stride, rows, weights, weights_stride, count, n);
#endif
    for (int q = 0; q < queries; ++q) {
#ifdef INFER_X86_KERNELS
        if constexpr (path != CpuKernels::Portable) {
            add_weighted_rows_avx2<dtype>(acc + q * acc_stride, rows, weights + q * weights_stride, count, n);
            continue;
        }
#endif
        add_weighted_rows_portable<dtype>(acc + q * acc_stride, rows, weights + q * weights_stride, count, n);
    }
}

template <CpuKernels path>
inline void add_weighted_rows(DType dtype, int queries, float* acc, size_t acc_stride, const std::byte* rows,
                              const float* weights, size_t weights_stride, int count, size_t n) {
    switch (dtype) {
        case DType::F16: return add_weighted_rows_with<path, DType::F16>(queries, acc, acc_stride, rows, weights, weights_stride, count, n);
        case DType::BF16: return add_weighted_rows_with<path, DType::BF16>(queries, acc, acc_stride, rows, weights, weights_stride, count, n);
        default: return add_weighted_rows_with<path, DType::F32>(queries, acc, acc_stride, rows, weights, weights_stride, count, n);
    }
}

// The same for a block-quantized w: each tile of rows is decoded to f32 once (appendix H), then multiplied by the float
// kernel above, so the arithmetic, and batch invariance, are exactly those of the decoded weights stored as F32.
inline void matmul_rows_dequantized(CpuKernels path, const Tensor& w, const float* x, int T, float* out, size_t row_begin,
                                    size_t row_end);

// The block types with an integer kernel take the integer path instead, as llama.cpp does: the activations are
// quantized once per call to 8-bit blocks with a scale each (QuantizedRows), every block product is an exact integer
// dot of int8 values, and only the scales are applied in f32, block after block in a fixed order, so batch invariance
// holds here too. Fewer bytes per weight and 64 multiply-adds per instruction: appendix H.
//
// Activations as 8-bit blocks, one row per token: llama.cpp's Q8_0 (blocks of 32, scale d = max|x|/127 stored as
// f16) for Q8_0, Q4_0 and Q5_0 weights, with Q8_1's s = f16(d·Σq) beside it for Q4_1 and Q5_1 (their minimum
// multiplies the block's sum), and its Q8_K (blocks of 256, d = −max/127 kept in f32, where max is the element of
// largest magnitude with its sign, plus the sum of each 16 values) for the K-quants. Rounding is to nearest, ties to
// even, as its x86 build does, so the blocks are bit-identical to llama.cpp's.
struct QuantizedRows {
    int block = 32;
    std::vector<int8_t> q;       // [T, K]
    std::vector<float> d;        // [T, K / block]
    std::vector<float> s;        // [T, K / 32], blocks of 32 only: Q8_1's s, d·Σq with the unrounded d, as f16
    std::vector<int16_t> sums;   // Q8_K: [T, K / 16], what the K-quants' minimums multiply; blocks of 32: [T, K / 32],
                                 // Σq of each block, what Q8_0's and Q4_0's offsets in row groups multiply
};

// From the type's row of dtype_blocks (section 02): a block type without an integer kernel takes the decode-to-f32
// path (matmul_rows_dequantized) until it gets an unpacking and a dot of its own in appendix H.
inline bool has_integer_kernel(DType dtype) { return dtype_block(dtype).activation_block != 0; }
inline int activation_block(DType dtype) { return dtype_block(dtype).activation_block; }
inline void size_quantized_rows(int T, size_t K, int block, QuantizedRows& out);
inline void quantize_activation_rows(const float* x, size_t K, QuantizedRows& out, size_t first_token, size_t end_token);
inline void quantize_activations(const float* x, int T, size_t K, int block, QuantizedRows& out);
inline void matmul_rows_integer(CpuKernels path, const Tensor& w, const QuantizedRows& x, int T, float* out, size_t row_begin,
                                size_t row_end);

// Batches of at least this many tokens are compute-bound: their matmul rows and attention items go to the threads in
// pieces that each claims as it finishes the last (ThreadPool::run_claimed), so a core slowed by other work on the
// machine does less of them. Smaller batches stream the weights, best as one contiguous range per thread: each
// thread's reads are then one sequential stream rather than pieces scattered over the matrix.
constexpr int claimed_from = 32;

// A parallel section of a forward pass over a batch of T tokens: `count` items in pieces of `piece` claimed by the
// threads from claimed_from tokens on, one contiguous range per thread below.
template <class Body>
inline void run_for_batch(ThreadPool& pool, int T, size_t count, size_t piece, size_t work, Body&& body) {
    if (T < claimed_from) pool.run_sized(count, work, body);
    else pool.run_claimed(count, piece, work, body);
}

#ifdef INFER_X86_KERNELS
[[gnu::target("avx2,fma,f16c")]] inline void swiglu_avx2(float* gate, const float* up, size_t count);  // appendix F
#endif

inline void swiglu(CpuKernels path, float* gate, const float* up, size_t count) {
#ifdef INFER_X86_KERNELS
    if (path != CpuKernels::Portable) return swiglu_avx2(gate, up, count);
#endif
    (void)path;
    swiglu_portable(gate, up, count);
}


// ---- The matmul's activations and its dispatch by weight type -------------------------------------------------------
// The activations of one matmul call in every form its products' kernels read: 8-bit blocks of 32 and of 256 for the
// integer kernels, bf16 for the bf16 products. Converted once per call for every product, each thread converting a
// share of the tokens.
struct ActivationForms {
    QuantizedRows by_32, by_256;
    AlignedVector<uint16_t> bf16;  // on 64-byte lines: a load across two runs at half speed
    bool bf16_products = false;
};

// The forms are the calling thread's: the workers reach them through the reference returned.
inline const ActivationForms& activation_forms(ThreadPool& pool, const float* x, int T, std::initializer_list<Product> products) {
    thread_local ActivationForms forms;
    const size_t K = static_cast<size_t>(products.begin()->w.cols());
    bool need_32 = false, need_256 = false;
    for (const Product& p : products)
        if (has_integer_kernel(p.w.dtype)) (activation_block(p.w.dtype) == 32 ? need_32 : need_256) = true;
    forms.bf16_products = bf16_activations() && std::any_of(products.begin(), products.end(), [](const Product& p) {
        return p.w.dtype == DType::BF16;
    });
    if (need_32) size_quantized_rows(T, K, 32, forms.by_32);
    if (need_256) size_quantized_rows(T, K, 256, forms.by_256);
    if (forms.bf16_products) forms.bf16.resize(static_cast<size_t>(T) * K);
    ActivationForms& shared = forms;  // a lambda would name the worker's own thread_local
    if (need_32 || need_256 || forms.bf16_products)
        pool.run_sized(static_cast<size_t>(T), static_cast<size_t>(T) * K * 4, [&](size_t begin, size_t end, int) {
            if (need_32) quantize_activation_rows(x, K, shared.by_32, begin, end);
            if (need_256) quantize_activation_rows(x, K, shared.by_256, begin, end);
            if (shared.bf16_products) round_activations_to_bf16(x + begin * K, (end - begin) * K, shared.bf16.data() + begin * K);
        });
    return forms;
}

// Rows [row_begin, row_end) of one product: the integer kernels for the block types that have one, the float tiles
// for f32, bf16 and f16, and the decode-to-f32 path for any other block type.
inline void product_rows(CpuKernels path, const Product& p, const float* x, const ActivationForms& forms, int T,
                         size_t row_begin, size_t row_end) {
    const size_t K = static_cast<size_t>(p.w.cols()), N = static_cast<size_t>(p.w.rows());
    if (has_integer_kernel(p.w.dtype))
        return matmul_rows_integer(path, p.w, activation_block(p.w.dtype) == 32 ? forms.by_32 : forms.by_256, T, p.out,
                                   row_begin, row_end);
    switch (p.w.dtype) {
        case DType::F32: return matmul_rows<DType::F32>(path, p.w.data, K, N, x, T, p.out, row_begin, row_end);
        case DType::BF16:
            if (forms.bf16_products) return matmul_rows_bf16(path, p.w.data, K, N, forms.bf16.data(), T, p.out, row_begin, row_end);
            return matmul_rows<DType::BF16>(path, p.w.data, K, N, x, T, p.out, row_begin, row_end);
        case DType::F16: return matmul_rows<DType::F16>(path, p.w.data, K, N, x, T, p.out, row_begin, row_end);
        default: return matmul_rows_dequantized(path, p.w, x, T, p.out, row_begin, row_end);
    }
}

// About four pieces per thread, each a multiple of 48 rows (whole row groups of every kernel: 3, 4 and 16 rows).
inline size_t matmul_piece(const ThreadPool& pool, size_t total_rows) {
    const size_t threads = static_cast<size_t>(pool.size());
    return std::max<size_t>(48, (total_rows + 4 * threads * 48 - 1) / (4 * threads * 48) * 48);
}
}  // namespace detail

// ---- Attention over the paged cache, chunk by chunk -----------------------------------------------------------------
// The chunked attention of section 04's ForwardPass: the items a batch's attention splits into, one item's scores,
// softmax weights and weighted values on a path's kernels, and the merge of a token's chunks.
// An item scores its whole chunk first, by the matmul's tile kernel with the cached keys as rows and the tile's query
// heads as its tokens (each key loaded serves all of them), then per query row takes the weights and the weighted sum
// of values (on AVX-512 four query rows at a time, so each value loaded serves four). Two passes over a chunk, keys
// then values, make each a run of 512 × Dh values that the hardware prefetchers stream from memory as they do the
// weights; where a sequence's blocks are not adjacent in the pool, the next block is requested ahead.

// The query tiles and items of a batch. A tile grows while the next token continues its sequence
// and sees the same chunks, so every query of an item sees some positions of each of the tile's chunks.
inline size_t ForwardPass::plan_attention(const Batch& batch) {
    const ModelConfig& c = model_.config;
    const size_t Dh = c.head_dim, group = static_cast<size_t>(c.n_heads / c.n_kv_heads);
    query_tiles_.clear();
    attention_items_.clear();
    merge_ranges_.clear();
    size_t partial_floats = 0, work = 0;
    for (size_t t = 0; t < batch.size();) {
        const int first_chunk = first_visible(batch.positions[t]) / attention_chunk;
        const int last_chunk = batch.positions[t] / attention_chunk;
        size_t end = t + 1;
        while (end < batch.size() && end - t < static_cast<size_t>(attention_queries) &&
               batch.sequences[end] == batch.sequences[t] && batch.positions[end] == batch.positions[end - 1] + 1 &&
               batch.positions[end] / attention_chunk == last_chunk &&
               first_visible(batch.positions[end]) / attention_chunk == first_chunk)
            ++end;
        const int tile = static_cast<int>(query_tiles_.size()), tokens = static_cast<int>(end - t);
        query_tiles_.push_back({static_cast<int>(t), tokens});
        const int seen_from = first_visible(batch.positions[t]), seen_to = batch.positions[end - 1] + 1;
        for (int h = 0; h < c.n_kv_heads; ++h) {
            merge_ranges_.push_back(attention_items_.size());
            for (int chunk = first_chunk; chunk <= last_chunk; ++chunk) {
                const int from = std::max(seen_from, chunk * attention_chunk), to = std::min(seen_to, (chunk + 1) * attention_chunk);
                attention_items_.push_back({tile, h, from, to, partial_floats, first_chunk == last_chunk});
                partial_floats += static_cast<size_t>(tokens) * group * (Dh + 2);
            }
        }
        for (size_t u = t; u < end; ++u)
            work += static_cast<size_t>(batch.positions[u] + 1 - first_visible(batch.positions[u])) * c.n_heads * Dh * 2;
        t = end;
    }
    merge_ranges_.push_back(attention_items_.size());
    if (partial_.size() < partial_floats) partial_.resize(partial_floats);
    const size_t rows = static_cast<size_t>(attention_queries) * group, threads = static_cast<size_t>(pool_.size());
    if (scores_.size() < threads * rows * attention_chunk) scores_.resize(threads * rows * attention_chunk);
    if (queries_.size() < threads * rows * Dh) queries_.resize(threads * rows * Dh);
    return work;
}

inline void ForwardPass::attend(CpuKernels path, const Batch& batch, const KVStorage& cache, const BlockTableOf& table_of,
                                int layer, size_t index, int thread) {
    switch (path) {
        case CpuKernels::Avx512: return attend_with<CpuKernels::Avx512>(batch, cache, table_of, layer, attention_items_[index], thread);
        case CpuKernels::Avx2: return attend_with<CpuKernels::Avx2>(batch, cache, table_of, layer, attention_items_[index], thread);
        default: return attend_with<CpuKernels::Portable>(batch, cache, table_of, layer, attention_items_[index], thread);
    }
}

template <CpuKernels path>
inline void ForwardPass::attend_with(const Batch& batch, const KVStorage& cache, const BlockTableOf& table_of,
                                     int layer, const AttentionItem& item, int thread) {
    const ModelConfig& c = model_.config;
    const size_t Dh = c.head_dim, group = static_cast<size_t>(c.n_heads / c.n_kv_heads);
    const size_t q_width = static_cast<size_t>(c.n_heads) * Dh;
    const QueryTile& tile = query_tiles_[item.tile];
    const size_t rows = static_cast<size_t>(tile.tokens) * group;  // query row r: token r / group, head r % group
    const std::vector<int>& table = table_of(batch.sequences[tile.first_token]);
    const int B = cache.block_size();
    // The tile's query heads side by side, [rows, Dh], as the tile kernel takes its tokens, times 1/sqrt(Dh): the
    // scores come out scaled.
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
    float* queries = &queries_[static_cast<size_t>(thread) * attention_queries * group * Dh];
    for (int j = 0; j < tile.tokens; ++j) {
        const float* q = &q_[(tile.first_token + j) * q_width + item.kv_head * group * Dh];
        for (size_t i = 0; i < group * Dh; ++i) queries[j * group * Dh + i] = q[i] * scale;
    }
    float* scores = &scores_[static_cast<size_t>(thread) * attention_queries * group * attention_chunk];  // [rows, n]
    float* partial = &partial_[item.partial];  // per row: max, sum, values [Dh]
    const int n = item.end - item.first;

    // The next block's run is asked for ahead when it does not follow this one in memory: the hardware prefetchers
    // carry a run across adjacent blocks but not across a jump, and a sequence that grew a block at a time beside
    // others has a jump at every block.
    const size_t block_run_bytes = static_cast<size_t>(B) * dtype_bytes(cache.dtype(), static_cast<int64_t>(Dh));
    auto jumps_before = [&table](int block_index) { return table[block_index] != table[block_index - 1] + 1; };

    // The chunk's keys, one KV block's run of slots at a time.
    for (int p = item.first; p < item.end;) {
        const int slot = p % B, run = std::min(item.end - p, B - slot);
        if (p + run < item.end && jumps_before(p / B + 1))
            detail::prefetch_bytes(cache.key(layer, table[p / B + 1], item.kv_head, 0), block_run_bytes);
        detail::dot_cached_rows<path>(cache.dtype(), cache.key(layer, table[p / B], item.kv_head, slot), Dh,
                                      static_cast<size_t>(n), queries, static_cast<int>(rows), scores + (p - item.first),
                                      static_cast<size_t>(run));
        p += run;
    }
    // The positions [from, to) of the chunk that query row r may see.
    const auto visible = [&](size_t r) {
        const int position = batch.positions[tile.first_token + static_cast<int>(r / group)];
        return std::pair{std::max(item.first, first_visible(position)), std::min(item.end, position + 1)};
    };
    for (size_t r = 0; r < rows; ++r) {
        const auto [from, to] = visible(r);
        float* row_partial = &partial[r * (Dh + 2)];  // max, sum, values [Dh]
        row_partial[0] = -std::numeric_limits<float>::infinity(), row_partial[1] = 0.0f;
        float* values = row_partial + 2;
        std::fill(values, values + Dh, 0.0f);
        if (from >= to) continue;  // nothing this query may see in the chunk: a weight of zero in the merge
        float* weights = scores + r * n;  // [j]: position item.first + j's score, then its weight
        const int first = from - item.first, last = to - item.first;
        const float chunk_max = detail::largest(weights + first, last - first);
        row_partial[0] = chunk_max;
        row_partial[1] = detail::softmax_exp_rows<path>(weights + first, last - first, chunk_max);
    }
    // The weighted values of query rows [first_row, first_row + queries) over positions [from, to), one KV block's
    // run of slots at a time.
    const auto add_values = [&](size_t first_row, int queries, int from, int to) {
        for (int p = from; p < to;) {
            const int slot = p % B, run = std::min(to - p, B - slot);
            if (p + run < to && jumps_before(p / B + 1))
                detail::prefetch_bytes(cache.value(layer, table[p / B + 1], item.kv_head, 0), block_run_bytes);
            detail::add_weighted_rows<path>(cache.dtype(), queries, &partial[first_row * (Dh + 2) + 2], Dh + 2,
                                            cache.value(layer, table[p / B], item.kv_head, slot),
                                            scores + first_row * n + (p - item.first), static_cast<size_t>(n), run, Dh);
            p += run;
        }
    };
    // Four rows at a time over the positions all four see (causal rows of a prompt differ only in their last few),
    // each row alone before and after those: every element's sum still runs in position order.
    for (size_t r0 = 0; r0 < rows; r0 += 4) {
        const int queries = static_cast<int>(std::min<size_t>(4, rows - r0));
        int shared_from = item.first, shared_to = item.end;
        for (int q = 0; q < queries; ++q) {
            shared_from = std::max(shared_from, visible(r0 + q).first);
            shared_to = std::min(shared_to, visible(r0 + q).second);
        }
        if (queries < 4 || shared_from >= shared_to) {
            for (int q = 0; q < queries; ++q) add_values(r0 + q, 1, visible(r0 + q).first, visible(r0 + q).second);
            continue;
        }
        for (int q = 0; q < queries; ++q) add_values(r0 + q, 1, visible(r0 + q).first, shared_from);
        add_values(r0, queries, shared_from, shared_to);
        for (int q = 0; q < queries; ++q) add_values(r0 + q, 1, shared_to, visible(r0 + q).second);
    }
    if (item.whole)
        for (size_t r = 0; r < rows; ++r) {
            float* out = &attn_[(tile.first_token + r / group) * q_width + (item.kv_head * group + r % group) * Dh];
            const float* values = &partial[r * (Dh + 2) + 2];
            for (size_t d = 0; d < Dh; ++d) out[d] = values[d] / partial[r * (Dh + 2) + 1];
        }
}

// The chunks of one query tile and KV head, in order, per query row: each chunk's values and sum weighed by
// exp(its max − the max).
inline void ForwardPass::merge_chunks(size_t tile_head) {
    const size_t first = merge_ranges_[tile_head], end = merge_ranges_[tile_head + 1];
    const AttentionItem& lead = attention_items_[first];
    if (lead.whole) return;  // written by its only item
    const ModelConfig& c = model_.config;
    const size_t Dh = c.head_dim, group = static_cast<size_t>(c.n_heads / c.n_kv_heads);
    const size_t q_width = static_cast<size_t>(c.n_heads) * Dh;
    const QueryTile& tile = query_tiles_[lead.tile];
    for (size_t r = 0; r < static_cast<size_t>(tile.tokens) * group; ++r) {
        float best = -std::numeric_limits<float>::infinity(), total = 0.0f;
        for (size_t item = first; item < end; ++item) best = std::max(best, partial_[attention_items_[item].partial + r * (Dh + 2)]);
        float* out = &attn_[(tile.first_token + r / group) * q_width + (lead.kv_head * group + r % group) * Dh];
        std::fill(out, out + Dh, 0.0f);
        for (size_t item = first; item < end; ++item) {
            const float* partial = &partial_[attention_items_[item].partial + r * (Dh + 2)];
            const float weight = std::exp(partial[0] - best);
            total += partial[1] * weight;
            for (size_t d = 0; d < Dh; ++d) out[d] += partial[2 + d] * weight;
        }
        for (size_t d = 0; d < Dh; ++d) out[d] /= total;
    }
}

// ---- The SIMD twins -------------------------------------------------------------------------------------------------
namespace detail {

#ifdef INFER_X86_KERNELS
template <DType dtype>
[[gnu::target("avx2,fma,f16c")]] inline __m256 load8_avx2(const std::byte* row, size_t k) {
    if constexpr (dtype == DType::F32) {
        return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    } else {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + k));
        if constexpr (dtype == DType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        else return _mm256_cvtph_ps(half);
    }
}

// fold_lanes's tree on lanes l + l+8 already added: pairs four apart, then two, then one.
[[gnu::target("avx2,fma,f16c")]] inline float horizontal_sum(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

// The 64 bytes from `at` on, in one register, loaded as two 32-byte halves. GGUF files align tensors to 32 bytes, so
// about half of a file's matrices start 32 bytes into a cache line, and every 64-byte load of their rows then spans two
// lines, which costs the load twice; 32-byte loads never span two lines there, and at most one of the two does where a
// tensor starts elsewhere (safetensors: 8 bytes apart). The values, and so the bits, are the same.
// (The zero-masked forms here and below: GCC 12's plain ones start from an undefined register, which -Wuninitialized
// reports.)
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] inline __m512 load64_in_halves(const std::byte* at) {
    const __m256d low = _mm256_loadu_pd(reinterpret_cast<const double*>(at));
    const __m256d high = _mm256_loadu_pd(reinterpret_cast<const double*>(at + 32));
    const __m512d low_half = _mm512_maskz_insertf64x4(0xFF, _mm512_setzero_pd(), low, 0);
    return _mm512_castpd_ps(_mm512_maskz_insertf64x4(0xFF, low_half, high, 1));
}

// Sixteen weights from column k on, as floats.
template <DType dtype>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] inline __m512 load16_avx512(const std::byte* row, size_t k) {
    if constexpr (dtype == DType::F32) {
        return load64_in_halves(row + k * 4);
    } else {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(row) + k));
        if constexpr (dtype == DType::BF16)
            return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, half), 16));
        else return _mm512_maskz_cvtph_ps(0xFFFF, half);
    }
}

// How many of the steps 0 … steps − 1 ask for lines of the next block: those whose number is a multiple of 2^pace.
inline size_t asking_steps(size_t steps, unsigned pace) { return (steps + (size_t{1} << pace) - 1) >> pace; }

// A tile asks for its share of the next block (section 04's Prefetch) while it reads its own rows: R lines in one step
// out of 2^pace (a step: one register's width of columns of R rows). Row group `group`, of `steps` steps, asks from
// the share's start + group · (the lines a group asks for) on; a group that starts past the share's end, or a tile with
// no share, asks for nothing (0). Addresses, not pointers, here and for own rows: the requests may reach past the
// share (even past the weights), which a hint allows and pointer arithmetic does not.
inline uintptr_t group_requests(Prefetch ahead, size_t group, size_t steps, int R) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(ahead.begin);
    const uintptr_t at = begin + group * asking_steps(steps, ahead.pace) * R * 64;
    return at < begin + ahead.bytes ? at : 0;
}

// The first of the next block's lines that a group asks for in a call from step first_step on: the group asks in the
// steps whose number is a multiple of 2^pace, R lines each, from address next_block on (0: it asks for none).
template <int R>
inline uintptr_t first_request(uintptr_t next_block, size_t first_step, unsigned pace) {
    return next_block == 0 ? 0 : next_block + asking_steps(first_step, pace) * R * 64;
}

// The requests of step `step` of R rows (row_bytes apart), which reads the bytes from `offset` on in each: with
// own_rows, the line tile_prefetch_bytes<C> / R past that offset in every row (past the row's end, in the same row
// of the next R rows: R · row_bytes further on); otherwise, where step & ask_mask is 0, R lines of the next block
// from address `next_lines` on, which then moves past them (0: none). Always inlined: the kernels' loops must keep
// them (a plain helper's were dropped).
template <int R, int C>
[[gnu::always_inline]] inline void request_ahead(const std::byte* row, size_t row_bytes, size_t offset, bool own_rows,
                                                 uintptr_t& next_lines, size_t step, size_t ask_mask) {
    if (own_rows) {
        size_t ahead = offset + tile_prefetch_bytes<C> / R;
        if (ahead >= row_bytes) ahead += (R - 1) * row_bytes;  // row r's end continues in row r + R
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row + r * row_bytes) + ahead),
                         _MM_HINT_T0);
    } else if (next_lines != 0 && (step & ask_mask) == 0) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next_lines + r * 64), _MM_HINT_T1);
        next_lines += R * 64;
    }
}

// The column panels of a tile that finds its rows in L2 (section 04's tile_activation_bytes): equal multiples of 16
// columns, as few as let one panel of C tokens' activations fit in `budget`. A tile that reads its rows from memory
// (own_rows) keeps one: its requests run ahead along each row.
struct ColumnPanels {
    size_t columns, count;
};
inline ColumnPanels column_panels(size_t K16, int C, size_t budget, bool own_rows) {
    const size_t activation_bytes = static_cast<size_t>(C) * K16 * 4;
    const size_t wanted = own_rows ? 1 : std::max<size_t>(1, (activation_bytes + budget - 1) / budget);
    const size_t columns = (K16 / 16 + wanted - 1) / wanted * 16;
    return {columns, K16 == 0 ? 1 : (K16 + columns - 1) / columns};  // none left empty by the rounding
}

// R rows (row_bytes apart) against C tokens over the columns [k_begin, k_end): R·C sums in registers; and the
// requests, for the tile's own rows ahead or from address `next_block` on. A panel that does not start at column 0
// resumes the sums `partial` holds (row r's C sums from partial + r·C); one that ends before the last block of 16
// leaves them there, and the last one writes the outputs.
template <DType dtype, int R, int C>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] inline void rows_avx512(const std::byte* row, size_t row_bytes,
                                                                                    const float* x, size_t K,
                                                                                    size_t k_begin, size_t k_end,
                                                                                    __m512* partial, float* out,
                                                                                    size_t N, bool own_rows,
                                                                                    uintptr_t next_block, unsigned pace) {
    constexpr size_t column_bytes = dtype == DType::F32 ? 4 : 2;
    const size_t K16 = K / 16 * 16, ask_mask = (size_t{1} << pace) - 1;
    uintptr_t next_lines = first_request<R>(next_block, k_begin / 16, pace);
    __m512 sums[R][C];  // all sixteen lanes of each sum
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) sums[r][c] = k_begin == 0 ? _mm512_setzero_ps() : partial[r * C + c];
    for (size_t k = k_begin; k < k_end; k += 16) {
        // Own rows: one request per line read (16 columns are a line of f32 weights, half a line of 16-bit ones).
        if (!own_rows || column_bytes == 4 || k % 32 == 0)
            request_ahead<R, C>(row, row_bytes, k * column_bytes, own_rows, next_lines, k / 16, ask_mask);
        __m512 w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) w[r] = load16_avx512<dtype>(row + r * row_bytes, k);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            __m512 xv = _mm512_loadu_ps(x + c * K + k);
            // An empty statement that claims to change xv: without it GCC folds the load into each of the R
            // multiply-adds, reading every activation R times, and the loads then bound the loop.
            __asm__("" : "+v"(xv));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) sums[r][c] = _mm512_fmadd_ps(w[r], xv, sums[r][c]);
        }
    }
    if (k_end < K16) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) partial[r * C + c] = sums[r][c];
        return;
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            alignas(64) float lanes[16];  // through memory: GCC 12 warns on the register casts (see load16_avx512)
            _mm512_store_ps(lanes, sums[r][c]);
            const __m256 half = _mm256_add_ps(_mm256_load_ps(lanes), _mm256_load_ps(lanes + 8));
            out[c * N + r] = finish_dot<dtype>(row + r * row_bytes, x + c * K, K16, K, horizontal_sum(half));
        }
}

template <DType dtype, int C>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] void tile_avx512(const std::byte* weights, size_t row_bytes,
                                                                             size_t rows, const float* x, size_t K, float* out,
                                                                             size_t N, Prefetch ahead) {
    constexpr int R = tile_rows;  // each activation load serves R rows
    const size_t K16 = K / 16 * 16;
    const ColumnPanels panels = column_panels(K16, C, tile_activation_bytes, ahead.own_rows);
    constexpr size_t chunk_rows = 8 * R;  // rows whose sums wait in `partial` between panels
    __m512 partial[chunk_rows][C];
    // (With one panel the chunks change nothing: a chunk is whole groups of three, so the rows go in the same order.)
    for (size_t chunk = 0; chunk < rows; chunk += chunk_rows) {
        const size_t chunk_end = std::min(rows, chunk + chunk_rows);
        for (size_t panel = 0; panel < panels.count; ++panel) {
            const size_t k_begin = panel * panels.columns, k_end = std::min(K16, k_begin + panels.columns);
            size_t n = chunk;
            for (; n + R <= chunk_end; n += R)
                rows_avx512<dtype, R, C>(weights + n * row_bytes, row_bytes, x, K, k_begin, k_end, partial[n - chunk],
                                         out + n, N, ahead.own_rows, group_requests(ahead, n / R, K / 16, R), ahead.pace);
            for (; n < chunk_end; ++n)
                rows_avx512<dtype, 1, C>(weights + n * row_bytes, row_bytes, x, K, k_begin, k_end, partial[n - chunk],
                                         out + n, N, ahead.own_rows, 0, 0);
        }
    }
}

// The AVX2 twin of rows_avx512: R rows against C tokens over the columns [k_begin, k_end), each sum in two registers
// (lanes 0–7 and 8–15), with the same panels (partial: sixteen floats per sum) and the same requests ahead. A pass of
// two tokens asks as far ahead as a tile of pass_request_tokens would (3.6 KB along each of three rows), not two
// tokens' own distance (32 KB), which runs too far ahead of the rows it reads.
constexpr int pass_request_tokens = 6;
template <DType dtype, int R, int C>
[[gnu::target("avx2,fma,f16c")]] inline void rows_avx2(const std::byte* row, size_t row_bytes, const float* x, size_t K,
                                                       size_t k_begin, size_t k_end, float* partial, float* out, size_t N,
                                                       bool own_rows, uintptr_t next_block, unsigned pace) {
    constexpr size_t column_bytes = dtype == DType::F32 ? 4 : 2;
    const size_t K16 = K / 16 * 16, ask_mask = (size_t{1} << pace) - 1;
    const bool asks = own_rows || next_block != 0;
    uintptr_t next_lines = first_request<R>(next_block, k_begin / 16, pace);
    __m256 sums[2][R][C];  // [lanes 0–7 or 8–15][row][token]
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c)
                sums[half][r][c] = k_begin == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + 16 * (r * C + c) + 8 * half);
    for (size_t k = k_begin; k < k_end; k += 16) {
        if (asks && (!own_rows || column_bytes == 4 || k % 32 == 0))
            request_ahead<R, pass_request_tokens>(row, row_bytes, k * column_bytes, own_rows, next_lines, k / 16, ask_mask);
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
            __m256 w[R];
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                __m256 weight = load8_avx2<dtype>(row + r * row_bytes, k + 8 * half);
                // With several rows, an empty statement that claims to change each loaded value keeps it in a
                // register (as in rows_avx512): otherwise GCC folds the loads into the multiply-adds and reads every
                // weight C times and every activation R times. (On a named value, not an array element: on one,
                // GCC keeps the whole array in memory.)
                if constexpr (R > 1) __asm__("" : "+x"(weight));
                w[r] = weight;
            }
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                __m256 xv = _mm256_loadu_ps(x + c * K + k + 8 * half);
                if constexpr (R > 1) __asm__("" : "+x"(xv));
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) sums[half][r][c] = _mm256_fmadd_ps(w[r], xv, sums[half][r][c]);
            }
        }
    }
    if (k_end < K16) {
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half)
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) _mm256_storeu_ps(partial + 16 * (r * C + c) + 8 * half, sums[half][r][c]);
        return;
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            out[c * N + r] = finish_dot<dtype>(row + r * row_bytes, x + c * K, K16, K,
                                               horizontal_sum(_mm256_add_ps(sums[0][r][c], sums[1][r][c])));
}

// One row at a time against C tokens, over all its columns, asking for nothing ahead: one stream.
template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] void tile_avx2(const std::byte* weights, size_t row_bytes, size_t rows, const float* x,
                                                 size_t K, float* out, size_t N) {
    for (size_t n = 0; n < rows; ++n)
        rows_avx2<dtype, 1, C>(weights + n * row_bytes, row_bytes, x, K, 0, K / 16 * 16, nullptr, out + n, N, false, 0, 0);
}

// R rows against C tokens over the columns [k_begin, k_end), as rows_avx2, but each sum's low eight lanes and then its
// high eight, over a span of columns at a time: a sum is then one register, and 3 rows × 4 tokens fit (12 of the 16
// registers, beside three weights and one activation) where whole sums fit 3 × 2. Each lane still adds its columns in
// order and the halves meet only at the end, so the bits are rows_avx2's. Each weight loaded serves four tokens and
// each activation three rows; the high half finds the span's rows in L1, and asks for nothing. Its sums wait in
// memory between the halves (`held`), 24 stores and loads per span.
template <DType dtype, int R, int C>
[[gnu::target("avx2,fma,f16c")]] inline void rows_avx2_by_halves(const std::byte* row, size_t row_bytes, const float* x,
                                                                 size_t K, size_t k_begin, size_t k_end, float* partial,
                                                                 float* out, size_t N, bool own_rows, uintptr_t next_block,
                                                                 unsigned pace) {
    constexpr size_t column_bytes = dtype == DType::F32 ? 4 : 2;
    // 1 KB of each row whatever the type (256 f32 columns, 512 16-bit ones): short enough that the high half finds the
    // span's rows still in L1, long enough that the held sums' stores and loads stay few beside the multiply-adds.
    constexpr size_t span_columns = 1024 / column_bytes;
    const size_t K16 = K / 16 * 16, ask_mask = (size_t{1} << pace) - 1;
    const bool asks = own_rows || next_block != 0;
    uintptr_t next_lines = first_request<R>(next_block, k_begin / 16, pace);
    alignas(32) float held[2][R][C][8];  // [lanes 0–7 or 8–15][row][token]
    for (int half = 0; half < 2; ++half)
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c)
                _mm256_store_ps(held[half][r][c], k_begin == 0 ? _mm256_setzero_ps()
                                                               : _mm256_loadu_ps(partial + 16 * (r * C + c) + 8 * half));
    for (size_t span = k_begin; span < k_end; span += span_columns) {
        const size_t span_end = std::min(k_end, span + span_columns);
#pragma GCC unroll 1
        for (int half = 0; half < 2; ++half) {
            __m256 sums[R][C];
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) sums[r][c] = _mm256_load_ps(held[half][r][c]);
            for (size_t k = span; k < span_end; k += 16) {
                if (half == 0 && asks && (!own_rows || column_bytes == 4 || k % 32 == 0))
                    request_ahead<R, C>(row, row_bytes, k * column_bytes, own_rows, next_lines, k / 16, ask_mask);
                __m256 w[R];
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    __m256 weight = load8_avx2<dtype>(row + r * row_bytes, k + 8 * half);
                    __asm__("" : "+x"(weight));  // kept in a register, as in rows_avx2
                    w[r] = weight;
                }
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) {
                    __m256 xv = _mm256_loadu_ps(x + c * K + k + 8 * half);
                    __asm__("" : "+x"(xv));
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) sums[r][c] = _mm256_fmadd_ps(w[r], xv, sums[r][c]);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) _mm256_store_ps(held[half][r][c], sums[r][c]);
        }
    }
    if (k_end < K16) {
        for (int half = 0; half < 2; ++half)
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < C; ++c)
                    _mm256_storeu_ps(partial + 16 * (r * C + c) + 8 * half, _mm256_load_ps(held[half][r][c]));
        return;
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            const __m256 sum = _mm256_add_ps(_mm256_load_ps(held[0][r][c]), _mm256_load_ps(held[1][r][c]));
            out[c * N + r] = finish_dot<dtype>(row + r * row_bytes, x + c * K, K16, K, horizontal_sum(sum));
        }
}

// An AVX2 tile three rows at a time, as tile_avx512 reads its rows, in passes of four tokens (rows_avx2_by_halves), or
// of two for a tile of 2 (rows_avx2: 3 rows × 2 tokens × two registers per sum). Only the first pass asks ahead; the
// other finds the rows in L2. (The chunk and panel loops are tile_avx512's: a shared helper would take the kernels in
// a lambda, which does not inherit their target attribute: built for a CPU without AVX-512, GCC then calls
// rows_avx512 once per group instead of inlining it.)
template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] void three_row_tile_avx2(const std::byte* weights, size_t row_bytes, size_t rows,
                                                           const float* x, size_t K, float* out, size_t N, Prefetch ahead) {
    constexpr int R = tile_rows, P = C % 4 == 0 ? 4 : 2;  // rows per group, tokens per pass
    static_assert(C % P == 0);
    const size_t K16 = K / 16 * 16;
    const ColumnPanels panels = column_panels(K16, P, pass_activation_bytes, ahead.own_rows);
    constexpr size_t chunk_rows = 8 * R;  // rows whose sums wait in `partial` between panels
    alignas(32) float partial[chunk_rows][P][16];
    for (int pass = 0; pass < C; pass += P) {
        const Prefetch asks = pass == 0 ? ahead : Prefetch{};
        const float* pass_x = x + pass * K;
        float* pass_out = out + pass * N;
        for (size_t chunk = 0; chunk < rows; chunk += chunk_rows) {
            const size_t chunk_end = std::min(rows, chunk + chunk_rows);
            for (size_t panel = 0; panel < panels.count; ++panel) {
                const size_t k_begin = panel * panels.columns, k_end = std::min(K16, k_begin + panels.columns);
                size_t n = chunk;
                for (; n + R <= chunk_end; n += R) {
                    const std::byte* group = weights + n * row_bytes;
                    const uintptr_t next_block = group_requests(asks, n / R, K / 16, R);
                    if constexpr (P == 4)
                        rows_avx2_by_halves<dtype, R, P>(group, row_bytes, pass_x, K, k_begin, k_end, partial[n - chunk][0],
                                                         pass_out + n, N, asks.own_rows, next_block, asks.pace);
                    else
                        rows_avx2<dtype, R, P>(group, row_bytes, pass_x, K, k_begin, k_end, partial[n - chunk][0],
                                               pass_out + n, N, asks.own_rows, next_block, asks.pace);
                }
                for (; n < chunk_end; ++n)
                    rows_avx2<dtype, 1, P>(weights + n * row_bytes, row_bytes, pass_x, K, k_begin, k_end, partial[n - chunk][0],
                                           pass_out + n, N, asks.own_rows, 0, 0);
            }
        }
    }
}

// The bf16 products (section 04) with vdpbf16ps: each instruction adds, in every one of 16 lanes, the product of the
// lane's odd column and then of its even column to the lane, which is the definition's two roundings (with
// subnormals flushed, as the instruction always does). A sum is one register; R rows × C tokens of them.
inline bool cpu_runs_bf16_avx512() {
    static const bool bf16 = cpu_supports(CpuKernels::Avx512) && __builtin_cpu_supports("avx512bf16");
    return bf16;
}

template <int R, int C>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]] inline void bf16_rows_avx512(const std::byte* row,
                                                                                                   size_t row_bytes,
                                                                                                   const uint16_t* x,
                                                                                                   size_t K, float* out,
                                                                                                   size_t N, bool own_rows,
                                                                                                   uintptr_t next_block,
                                                                                                   unsigned pace) {
    const size_t K32 = K / 32 * 32, ask_mask = (size_t{1} << pace) - 1;
    uintptr_t next_lines = first_request<R>(next_block, 0, pace);
    __m512 sums[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) sums[r][c] = _mm512_setzero_ps();
    for (size_t k = 0; k < K32; k += 32) {
        request_ahead<R, C>(row, row_bytes, k * 2, own_rows, next_lines, k / 32, ask_mask);  // a step: a line of each row
        __m512bh w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) w[r] = (__m512bh)load64_in_halves(row + r * row_bytes + k * 2);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c * K + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], w[r], xv);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            alignas(64) float lanes[16];  // as rows_avx512
            _mm512_store_ps(lanes, sums[r][c]);
            const __m256 half = _mm256_add_ps(_mm256_load_ps(lanes), _mm256_load_ps(lanes + 8));
            out[c * N + r] = finish_bf16_dot(row + r * row_bytes, x + c * K, K32, K, horizontal_sum(half));
        }
}

template <int C>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]] void bf16_tile_avx512(const std::byte* weights,
                                                                                            size_t row_bytes, size_t rows,
                                                                                            const uint16_t* x, size_t K,
                                                                                            float* out, size_t N,
                                                                                            Prefetch ahead) {
    // 3 rows × 8 tokens of sums + 3 weights + 1 activation of the 32 registers, as the float tile. Fewer tokens take 4
    // rows at a time: one row and one token would be a single chain of vdpbf16ps, whose latency then bounds the loop
    // below the memory's rate.
    constexpr int R = C == 8 ? tile_rows : 4;
    size_t n = 0;
    for (; n + R <= rows; n += R)
        bf16_rows_avx512<R, C>(weights + n * row_bytes, row_bytes, x, K, out + n, N, ahead.own_rows,
                               group_requests(ahead, n / R, K / 32, R), ahead.pace);
    for (; n < rows; ++n) bf16_rows_avx512<1, C>(weights + n * row_bytes, row_bytes, x, K, out + n, N, ahead.own_rows, 0, 0);
}

// exp_nonpositive's operations on eight lanes.
[[gnu::target("avx2,fma,f16c")]] inline __m256 exp_nonpositive_avx2(__m256 x) {
    using namespace exp_nonpositive_constants;
    const __m256 shifted = _mm256_fmadd_ps(x, _mm256_set1_ps(log2_e), _mm256_set1_ps(round_shift));
    const __m256 n = _mm256_sub_ps(shifted, _mm256_set1_ps(round_shift));
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-ln2_low), _mm256_fmadd_ps(n, _mm256_set1_ps(-ln2_high), x));
    __m256 p = _mm256_set1_ps(taylor[0]);
#pragma GCC unroll 8
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(taylor[i]));
    const __m256i exponent_step = _mm256_slli_epi32(
        _mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(static_cast<int>(round_shift_bits))), 23);
    const __m256 value = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent_step));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(cutoff), _CMP_LT_OQ), value);
}

// Eight weights at a time, summed lane by lane; the last count % 8 in the scalar form, which adds the lanes.
[[gnu::target("avx2,fma,f16c")]] inline float softmax_exp_rows_avx2(float* s, int count, float max) {
    __m256 sums = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= count; j += 8) {
        const __m256 weights = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(max)));
        _mm256_storeu_ps(s + j, weights);
        sums = _mm256_add_ps(sums, weights);
    }
    float partial[8];
    _mm256_storeu_ps(partial, sums);
    return softmax_exp_rows_from(s, j, count, max, partial);
}

// silu's operations on eight lanes (−|x| by setting the sign bit); the last count % 8 elements in the scalar form.
[[gnu::target("avx2,fma,f16c")]] inline void swiglu_avx2(float* gate, const float* up, size_t count) {
    const __m256 one = _mm256_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_nonpositive_avx2(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
        const __m256 numerator = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
        const __m256 silu = _mm256_div_ps(_mm256_mul_ps(x, numerator), _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    swiglu_portable(gate + i, up + i, count - i);
}

// Up to 64 elements of the sum at a time, in eight registers across the rows: eight independent FMA chains, and
// each row read as one contiguous run.
template <DType dtype>
[[gnu::target("avx2,fma,f16c")]] inline void add_weighted_rows_avx2(float* acc, const std::byte* rows, const float* weights,
                                                                     int count, size_t n) {
    const size_t row_bytes = static_cast<size_t>(dtype_bytes(dtype, static_cast<int64_t>(n)));
    size_t d = 0;
    for (; d + 64 <= n; d += 64) {
        __m256 sums[8];
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) sums[s] = _mm256_loadu_ps(acc + d + 8 * s);
        for (int j = 0; j < count; ++j) {
            const __m256 weight = _mm256_set1_ps(weights[j]);
            const std::byte* row = rows + j * row_bytes;
#pragma GCC unroll 8
            for (int s = 0; s < 8; ++s) sums[s] = _mm256_fmadd_ps(weight, load8_avx2<dtype>(row, d + 8 * s), sums[s]);
        }
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) _mm256_storeu_ps(acc + d + 8 * s, sums[s]);
    }
    for (; d + 8 <= n; d += 8) {
        __m256 sum = _mm256_loadu_ps(acc + d);
        for (int j = 0; j < count; ++j)
            sum = _mm256_fmadd_ps(_mm256_set1_ps(weights[j]), load8_avx2<dtype>(rows + j * row_bytes, d), sum);
        _mm256_storeu_ps(acc + d, sum);
    }
    for (; d < n; ++d)
        for (int j = 0; j < count; ++j) acc[d] = std::fma(weights[j], weight_at<dtype>(rows + j * row_bytes, d), acc[d]);
}

// Four queries' sums, 64 elements of each at a time in sixteen registers: each value loaded serves the four queries,
// and a step is sixteen independent FMA chains. Elements past the last multiple of 64 go one at a time.
template <DType dtype>
[[gnu::target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")]] inline void add_weighted_rows4_avx512(
    float* acc, size_t acc_stride, const std::byte* rows, const float* weights, size_t weights_stride, int count,
    size_t n) {
    const size_t row_bytes = static_cast<size_t>(dtype_bytes(dtype, static_cast<int64_t>(n)));
    size_t d = 0;
    for (; d + 64 <= n; d += 64) {
        __m512 sums[4][4];  // [query][16 elements]
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
#pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) sums[q][s] = _mm512_loadu_ps(acc + q * acc_stride + d + 16 * s);
        for (int j = 0; j < count; ++j) {
            __m512 values[4];
#pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) values[s] = load16_avx512<dtype>(rows + j * row_bytes, d + 16 * s);
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {
                const __m512 weight = _mm512_set1_ps(weights[q * weights_stride + j]);
#pragma GCC unroll 4
                for (int s = 0; s < 4; ++s) sums[q][s] = _mm512_fmadd_ps(weight, values[s], sums[q][s]);
            }
        }
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
#pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) _mm512_storeu_ps(acc + q * acc_stride + d + 16 * s, sums[q][s]);
    }
    for (; d < n; ++d)
        for (int q = 0; q < 4; ++q)
            for (int j = 0; j < count; ++j)
                acc[q * acc_stride + d] =
                    std::fma(weights[q * weights_stride + j], weight_at<dtype>(rows + j * row_bytes, d), acc[q * acc_stride + d]);
}

#endif

}  // namespace detail

// ==== G RANDOM-WEIGHT MODELS =========================================================================================
// Models with random weights and a known shape: the built-in demo model (so the first command works with nothing
// downloaded) and `infer make-model` (a Hugging Face folder of any size, for benchmarks). Their output is meaningless;
// their cost per token is exactly that of a trained model of the same shape. (chapter 02)

// One tensor to write with save_safetensors.
struct TensorData {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
};

inline void save_safetensors(const std::filesystem::path& path, const std::vector<TensorData>& tensors) {
    std::ostringstream header;
    header << "{\"__metadata__\":{\"format\":\"pt\"}";
    uint64_t offset = 0;
    for (const TensorData& t : tensors) {
        header << ',';
        write_json_string(header, t.name);
        header << ":{\"dtype\":\"" << dtype_name(t.dtype) << "\",\"shape\":" << shape_string(t.shape)
               << ",\"data_offsets\":[" << offset << ',' << offset + t.bytes.size() << "]}";
        offset += t.bytes.size();
    }
    header << '}';
    std::string text = header.str();
    while ((text.size() + 8) % 8 != 0) text += ' ';  // the format pads the header so the data starts aligned
    std::ofstream out(path, std::ios::binary);
    if (!out) fail(path.string(), ": cannot create");
    uint64_t length = text.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xFF));
    out << text;
    for (const TensorData& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
    close_written_file(out, path.string());
}

struct ModelShape {
    int dim = 288, n_layers = 6, n_heads = 6, n_kv_heads = 6, ffn_dim = 768, vocab_size = 32000, context_length = 2048;
    bool tied_embeddings = false;  // the classifier is the embedding (llama2.c's stories models, SmolLM, Qwen2 0.5B)
};

// Hugging Face-named tensors with weights uniform in ±1/sqrt(fan-in) and unit norm gains, from a seeded generator.
inline std::vector<TensorData> random_weights(const ModelShape& shape, DType dtype, uint64_t seed) {
    if (shape.n_heads <= 0 || shape.dim % shape.n_heads != 0)
        fail("model shape: dim ", shape.dim, " is not a multiple of heads ", shape.n_heads);
    const int64_t D = shape.dim, F = shape.ffn_dim, V = shape.vocab_size, Dh = shape.dim / shape.n_heads;
    const int64_t q_width = shape.n_heads * Dh, kv_width = shape.n_kv_heads * Dh;
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    auto next_uniform = [&state] {  // splitmix64 → [-1, 1)
        state += 0x9E3779B97F4A7C15ull;
        uint64_t z = state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0);
    };
    std::vector<TensorData> tensors;
    auto add = [&](std::string name, std::vector<int64_t> dims, bool is_gain) {
        TensorData t{std::move(name), dtype, dims, {}};
        int64_t count = std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
        float range = is_gain ? 0 : 1.0f / std::sqrt(static_cast<float>(dims.back()));
        t.bytes.resize(static_cast<size_t>(dtype_bytes(dtype, count)));
        for (int64_t i = 0; i < count; ++i) {
            float value = is_gain ? 1.0f : next_uniform() * range;
            if (dtype == DType::F32) std::memcpy(&t.bytes[i * 4], &value, 4);
            else {
                uint16_t half = dtype == DType::BF16 ? f32_to_bf16(value) : f32_to_f16(value);
                std::memcpy(&t.bytes[i * 2], &half, 2);
            }
        }
        tensors.push_back(std::move(t));
    };
    add("model.embed_tokens.weight", {V, D}, false);
    for (int l = 0; l < shape.n_layers; ++l) {
        std::string p = "model.layers." + std::to_string(l) + ".";
        add(p + "input_layernorm.weight", {D}, true);
        add(p + "self_attn.q_proj.weight", {q_width, D}, false);
        add(p + "self_attn.k_proj.weight", {kv_width, D}, false);
        add(p + "self_attn.v_proj.weight", {kv_width, D}, false);
        add(p + "self_attn.o_proj.weight", {D, q_width}, false);
        add(p + "post_attention_layernorm.weight", {D}, true);
        add(p + "mlp.gate_proj.weight", {F, D}, false);
        add(p + "mlp.up_proj.weight", {F, D}, false);
        add(p + "mlp.down_proj.weight", {D, F}, false);
    }
    add("model.norm.weight", {D}, true);
    if (!shape.tied_embeddings) add("lm_head.weight", {V, D}, false);
    return tensors;
}

inline ModelConfig config_for_shape(const ModelShape& shape) {
    ModelConfig c;
    c.architecture = "llama";
    c.dim = shape.dim;
    c.n_layers = shape.n_layers;
    c.n_heads = shape.n_heads;
    c.n_kv_heads = shape.n_kv_heads;
    c.head_dim = shape.n_heads > 0 ? shape.dim / shape.n_heads : 0;
    c.ffn_dim = shape.ffn_dim;
    c.vocab_size = shape.vocab_size;
    c.context_length = shape.context_length;
    c.tied_embeddings = shape.tied_embeddings;
    c.bos_id = 1;
    c.eos_ids = {2};
    return c;
}

// Writes config.json + model.safetensors: a Hugging Face Llama folder that load_model reads back.
inline void save_random_model(const std::filesystem::path& folder, const ModelShape& shape, DType dtype, uint64_t seed) {
    ModelConfig c = config_for_shape(shape);
    detail::validate_config(c, folder.string());
    std::filesystem::create_directories(folder);
    std::ofstream config(folder / "config.json");
    if (!config) fail((folder / "config.json").string(), ": cannot create");
    config << "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n"
           << "  \"hidden_size\": " << c.dim << ",\n  \"intermediate_size\": " << c.ffn_dim << ",\n"
           << "  \"num_hidden_layers\": " << c.n_layers << ",\n  \"num_attention_heads\": " << c.n_heads << ",\n"
           << "  \"num_key_value_heads\": " << c.n_kv_heads << ",\n  \"vocab_size\": " << c.vocab_size << ",\n"
           << "  \"max_position_embeddings\": " << c.context_length << ",\n  \"rms_norm_eps\": 1e-05,\n"
           << "  \"rope_theta\": 10000.0,\n  \"hidden_act\": \"silu\",\n  \"tie_word_embeddings\": "
           << (c.tied_embeddings ? "true" : "false") << ",\n"
           << "  \"bos_token_id\": 1,\n  \"eos_token_id\": 2,\n  \"torch_dtype\": \""
           << (dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16") << "\"\n}\n";
    close_written_file(config, (folder / "config.json").string());
    save_safetensors(folder / "model.safetensors", random_weights(shape, dtype, seed));
}

// The built-in demo: a small random Llama with a byte-level vocabulary (<unk>, <s>, </s>, the 256 bytes and "▁"), so
// any text tokenizes and every output decodes. It produces gibberish at the speed of a real model of its shape.
inline Model demo_model() {
    ModelShape shape{.dim = 128, .n_layers = 4, .n_heads = 4, .n_kv_heads = 2, .ffn_dim = 384, .vocab_size = 260, .context_length = 1024};
    Model model;
    model.source = "built-in demo model";
    model.format = ModelFormat::BuiltIn;
    model.config = config_for_shape(shape);
    model.config.eos_ids.clear();  // random weights pick </s> by chance: let the demo run to max_tokens
    std::unordered_map<std::string, Tensor> tensors;
    for (TensorData& data : random_weights(shape, DType::F32, 2024)) {
        model.owned.push_back(std::move(data.bytes));
        tensors[data.name] = Tensor{data.name, data.dtype, data.shape, model.owned.back().data()};
    }
    detail::attach_tensors(model, tensors, detail::hugging_face_names);
    Vocabulary& vocab = model.vocab;
    auto add = [&](std::string piece, Vocabulary::Type type) {
        vocab.pieces.push_back(std::move(piece));
        vocab.scores.push_back(0);
        vocab.types.push_back(type);
    };
    add("<unk>", Vocabulary::Type::Unknown);
    add("<s>", Vocabulary::Type::Control);
    add("</s>", Vocabulary::Type::Control);
    for (int byte = 0; byte < 256; ++byte) {
        char piece[8];
        std::snprintf(piece, sizeof piece, "<0x%02X>", byte);
        add(piece, Vocabulary::Type::Byte);
    }
    add("\xE2\x96\x81", Vocabulary::Type::Normal);
    detail::validate_model(model);
    return model;
}

// ==== H QUANTIZED BLOCKS =============================================================================================
// The block formats of GGUF's quantized types, each decoded to f32 by a plain loop that follows the layout (the
// comments give it byte by byte; llama.cpp's ggml-quants.c and the GGUF specification are the references). Every
// product a decoder forms is exact in f32, so a correct decoder is bit-identical to llama.cpp's whatever its order.
// Then the integer kernels: the same blocks read as int8 and multiplied by 8-bit activations, their definition in a
// portable loop and its AVX2 and AVX-512 twins, which decode the blocks in registers; for Q8_0, Q4_0, Q4_K and Q6_K
// from row groups, sixteen rows interleaved at load time so one register holds four columns of all of them. Cost: a
// few operations per weight to decode; at decode time the integer kernels are bound by the weights' bytes, in prefill
// by their instructions per column quad and token. (chapter 02)

namespace detail {

inline float f16_at(const std::byte* p) {
    uint16_t half;
    std::memcpy(&half, p, 2);
    return f16_to_f32(half);
}
inline uint8_t byte_at(const std::byte* p, size_t i) { return static_cast<uint8_t>(p[i]); }
inline void put_f16(std::byte* p, float value) {
    const uint16_t half = f32_to_f16(value);
    std::memcpy(p, &half, 2);
}
inline float f16_round(float value) { return f16_to_f32(f32_to_f16(value)); }  // what a stored f16 reads back as

// The element of largest magnitude, its sign kept (the first on ties): Q4_0 and Q5_0 map it to their most negative
// level, so the sign of d carries the sign of the extreme and the full range −8…7 (−16…15) is used.
inline float signed_extreme(const float* x, int n) {
    float amax = 0.0f, extreme = 0.0f;
    for (int k = 0; k < n; ++k)
        if (amax < std::fabs(x[k])) {
            amax = std::fabs(x[k]);
            extreme = x[k];
        }
    return extreme;
}

// Q8_0, 34 bytes: d (f16), q[32] (int8). w = d·q.
inline void dequantize_q8_0(const std::byte* b, float* y) {
    const float d = f16_at(b);
    for (int k = 0; k < 32; ++k) y[k] = d * static_cast<float>(static_cast<int8_t>(byte_at(b, 2 + k)));
}

// Q4_0, 18 bytes: d (f16), qs[16]. Element k < 16 is the low nibble of qs[k], element k + 16 its high nibble.
// w = d·(nibble − 8). Q4_1, 20 bytes: d, m (f16), then the same nibbles; w = d·nibble + m.
inline void dequantize_q4(const std::byte* b, float* y, bool with_min) {
    const float d = f16_at(b), m = with_min ? f16_at(b + 2) : 0.0f;
    const std::byte* qs = b + (with_min ? 4 : 2);
    for (int k = 0; k < 16; ++k) {
        const int low = byte_at(qs, k) & 0x0F, high = byte_at(qs, k) >> 4;
        y[k] = with_min ? d * static_cast<float>(low) + m : d * static_cast<float>(low - 8);
        y[k + 16] = with_min ? d * static_cast<float>(high) + m : d * static_cast<float>(high - 8);
    }
}

// Q5_0, 22 bytes: d (f16), qh (32 fifth bits, little-endian u32), qs[16] as in Q4_0. Bit k of qh is element k's fifth
// bit, bit k + 16 element k + 16's. w = d·(q − 16). Q5_1, 24 bytes: d, m, qh, qs; w = d·q + m.
inline void dequantize_q5(const std::byte* b, float* y, bool with_min) {
    const float d = f16_at(b), m = with_min ? f16_at(b + 2) : 0.0f;
    uint32_t qh;
    std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
    const std::byte* qs = b + (with_min ? 8 : 6);
    for (int k = 0; k < 16; ++k) {
        const int low = (byte_at(qs, k) & 0x0F) | static_cast<int>(((qh >> k) & 1) << 4);
        const int high = (byte_at(qs, k) >> 4) | static_cast<int>(((qh >> (k + 16)) & 1) << 4);
        y[k] = with_min ? d * static_cast<float>(low) + m : d * static_cast<float>(low - 16);
        y[k + 16] = with_min ? d * static_cast<float>(high) + m : d * static_cast<float>(high - 16);
    }
}

// Q2_K, 84 bytes: scales[16] (low nibble a 4-bit scale, high nibble a 4-bit min, one pair per 16 weights), qs[64]
// (2-bit q), d and dmin (f16). Each half of 128 weights reads 32 bytes of qs four times, two bits further each pass;
// within a pass the first 16 bytes belong to one sub-block and the next 16 to the next. w = (d·sc)·q − (dmin·m).
inline void dequantize_q2_k(const std::byte* b, float* y) {
    const std::byte* scales = b;
    const std::byte* qs = b + 16;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    int sub = 0;
    for (int half = 0; half < 2; ++half, qs += 32)
        for (int shift = 0; shift < 8; shift += 2)
            for (int part = 0; part < 2; ++part, ++sub) {
                const int packed = byte_at(scales, sub);
                const float scale = d * static_cast<float>(packed & 0x0F), min = dmin * static_cast<float>(packed >> 4);
                for (int l = 0; l < 16; ++l) *y++ = scale * static_cast<float>((byte_at(qs, 16 * part + l) >> shift) & 3) - min;
            }
}

// Q3_K, 110 bytes: hmask[32] (the third bit of each q), qs[64] (two low bits, read as in Q2_K), scales[12] (sixteen
// 6-bit scales, biased by 32: the low 4 bits in bytes 0–7, the top 2 bits in bytes 8–11), d (f16). A q whose hmask
// bit is clear has 4 subtracted: q ∈ −4…3. w = (d·(sc − 32))·q.
inline void dequantize_q3_k(const std::byte* b, float* y) {
    const std::byte* hmask = b;
    const std::byte* qs = b + 32;
    const std::byte* packed = b + 96;
    const float d = f16_at(b + 108);
    int sc[16];
    for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? byte_at(packed, i) & 0x0F : byte_at(packed, i - 8) >> 4;
        const int high = (byte_at(packed, 8 + i % 4) >> (2 * (i / 4))) & 3;
        sc[i] = (low | high << 4) - 32;
    }
    int sub = 0, bit = 0;
    for (int half = 0; half < 2; ++half, qs += 32)
        for (int shift = 0; shift < 8; shift += 2, ++bit)
            for (int part = 0; part < 2; ++part, ++sub) {
                const float scale = d * static_cast<float>(sc[sub]);
                for (int l = 0; l < 16; ++l) {
                    const int i = 16 * part + l;
                    const int q = ((byte_at(qs, i) >> shift) & 3) - ((byte_at(hmask, i) >> bit) & 1 ? 0 : 4);
                    *y++ = scale * static_cast<float>(q);
                }
            }
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block, from its 12 packed bytes s: for j < 4, sc = s[j] & 63
// and m = s[j+4] & 63; for j ≥ 4, the low 4 bits come from s[j+4] (sc low nibble, m high nibble) and the top 2 bits
// from the spare top bits of s[j−4] (sc) and s[j] (m).
inline void k_scale_min(const std::byte* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = byte_at(s, j) & 63;
        m = byte_at(s, j + 4) & 63;
    } else {
        sc = (byte_at(s, j + 4) & 0x0F) | ((byte_at(s, j - 4) >> 6) << 4);
        m = (byte_at(s, j + 4) >> 4) | ((byte_at(s, j) >> 6) << 4);
    }
}

// k_scale_min for all eight sub-blocks at once, as bytes j of two words: the 12 bytes read as three 32-bit words
// s0, s1, s2, each byte's fields moved by the same shifts and masks.
inline void k_scales_and_mins(const std::byte* s, uint64_t& scales, uint64_t& minimums) {
    uint32_t w[3];
    std::memcpy(w, s, 12);
    scales = (w[0] & 0x3F3F3F3Fu) | uint64_t{(w[2] & 0x0F0F0F0Fu) | ((w[0] >> 6) & 0x03030303u) << 4} << 32;
    minimums = (w[1] & 0x3F3F3F3Fu) | uint64_t{((w[2] >> 4) & 0x0F0F0F0Fu) | ((w[1] >> 6) & 0x03030303u) << 4} << 32;
}

// Q4_K, 144 bytes: d, dmin (f16), 12 scale bytes, qs[128]. Four groups of 64 weights, group g in qs[32g..32g+31]:
// the low nibbles are sub-block 2g, the high nibbles sub-block 2g+1. w = (d·sc)·q − (dmin·m).
// Q5_K, 176 bytes: d, dmin, 12 scale bytes, qh[32], qs[128]: the same, with a fifth bit per weight in qh (bit 2g of
// qh[l] for the low nibble of group g, bit 2g+1 for the high one), q = low4 + 16·bit.
inline void dequantize_q45_k(const std::byte* b, float* y, bool five_bits) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const std::byte* scales = b + 4;
    const std::byte* qh = b + 16;
    const std::byte* qs = b + (five_bits ? 48 : 16);
    for (int g = 0; g < 4; ++g) {
        for (int nibble = 0; nibble < 2; ++nibble) {
            int sc, m;
            k_scale_min(scales, 2 * g + nibble, sc, m);
            const float scale = d * static_cast<float>(sc), min = dmin * static_cast<float>(m);
            for (int l = 0; l < 32; ++l) {
                int q = nibble ? byte_at(qs, 32 * g + l) >> 4 : byte_at(qs, 32 * g + l) & 0x0F;
                if (five_bits) q += ((byte_at(qh, l) >> (2 * g + nibble)) & 1) << 4;
                *y++ = scale * static_cast<float>(q) - min;
            }
        }
    }
}

// Q6_K, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, one per 16 weights), d (f16, last).
// Element e: h = e/128, r = e%128, g = r/32, l = r%32; low4 is the low (g < 2) or high nibble of ql[64h + l + 32(g&1)],
// high2 = (qh[32h + l] >> 2g) & 3, q = (low4 | high2 << 4) − 32. w = d·scales[e/16]·q.
inline void dequantize_q6_k(const std::byte* b, float* y) {
    const std::byte* ql = b;
    const std::byte* qh = b + 128;
    const std::byte* scales = b + 192;
    const float d = f16_at(b + 208);
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128, g = r / 32, l = r % 32;
        const int packed = byte_at(ql, 64 * h + l + 32 * (g & 1));
        const int low = g < 2 ? packed & 0x0F : packed >> 4;
        const int high = (byte_at(qh, 32 * h + l) >> (2 * g)) & 3;
        const int q = (low | high << 4) - 32;
        y[e] = d * static_cast<float>(static_cast<int8_t>(byte_at(scales, e / 16))) * static_cast<float>(q);
    }
}

}  // namespace detail

inline void dequantize_row(DType dtype, const std::byte* blocks, float* out, int64_t count) {
    const DTypeBlock& block = dtype_block(dtype);
    for (int64_t i = 0; i < count; i += block.elements, blocks += block.bytes, out += block.elements) {
        switch (dtype) {
            case DType::F32: std::memcpy(out, blocks, 4); break;
            case DType::F16: out[0] = detail::f16_at(blocks); break;
            case DType::BF16: {
                uint16_t half;
                std::memcpy(&half, blocks, 2);
                out[0] = bf16_to_f32(half);
                break;
            }
            case DType::Q8_0: detail::dequantize_q8_0(blocks, out); break;
            case DType::Q4_0: detail::dequantize_q4(blocks, out, false); break;
            case DType::Q4_1: detail::dequantize_q4(blocks, out, true); break;
            case DType::Q5_0: detail::dequantize_q5(blocks, out, false); break;
            case DType::Q5_1: detail::dequantize_q5(blocks, out, true); break;
            case DType::Q2_K: detail::dequantize_q2_k(blocks, out); break;
            case DType::Q3_K: detail::dequantize_q3_k(blocks, out); break;
            case DType::Q4_K: detail::dequantize_q45_k(blocks, out, false); break;
            case DType::Q5_K: detail::dequantize_q45_k(blocks, out, true); break;
            case DType::Q6_K: detail::dequantize_q6_k(blocks, out); break;
        }
    }
}

namespace detail {

inline void matmul_rows_dequantized(CpuKernels path, const Tensor& w, const float* x, int T, float* out, size_t row_begin,
                                    size_t row_end) {
    const size_t K = static_cast<size_t>(w.cols()), N = static_cast<size_t>(w.rows());
    const size_t row_bytes = static_cast<size_t>(dtype_bytes(w.dtype, static_cast<int64_t>(K)));
    constexpr size_t rows_per_tile = 16;
    thread_local AlignedVector<float> decoded;  // [16, K]: the tile's rows in f32, reused across calls
    decoded.resize(rows_per_tile * K);
    for (size_t tile = row_begin; tile < row_end; tile += rows_per_tile) {
        const size_t tile_end = std::min(row_end, tile + rows_per_tile);
        for (size_t n = tile; n < tile_end; ++n)
            dequantize_row(w.dtype, w.data + n * row_bytes, &decoded[(n - tile) * K], static_cast<int64_t>(K));
        matmul_rows<DType::F32>(path, reinterpret_cast<const std::byte*>(decoded.data()), K, N, x, T, out + tile, 0, tile_end - tile);
    }
}

// ---- Integer kernels: quantized activations times quantized weights -------------------------------------------------

// Sizes `out` for T tokens of K columns in blocks of `block`; quantize_activation_rows then fills any range of tokens
// (a thread's share), and quantize_activations all of them.
inline void size_quantized_rows(int T, size_t K, int block, QuantizedRows& out) {
    const size_t blocks = K / static_cast<size_t>(block);
    out.block = block;
    out.q.resize(static_cast<size_t>(T) * K);
    out.d.resize(static_cast<size_t>(T) * blocks);
    out.s.resize(block == 32 ? static_cast<size_t>(T) * blocks : 0);
    out.sums.resize(block == 256 ? static_cast<size_t>(T) * (K / 16) : static_cast<size_t>(T) * blocks);
}

inline void quantize_activations(const float* x, int T, size_t K, int block, QuantizedRows& out) {
    size_quantized_rows(T, K, block, out);
    quantize_activation_rows(x, K, out, 0, static_cast<size_t>(T));
}

inline void quantize_activation_rows(const float* x, size_t K, QuantizedRows& out, size_t first_token, size_t end_token) {
    const int block = out.block;
    const size_t blocks = K / static_cast<size_t>(block);
    for (size_t b = first_token * blocks; b < end_token * blocks; ++b) {
        const float* v = x + b * static_cast<size_t>(block);
        int8_t* q = out.q.data() + b * static_cast<size_t>(block);
        if (block == 32) {
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
            const float scale = amax != 0.0f ? 127.0f / amax : 0.0f;
            out.d[b] = f16_round(amax / 127.0f);
            int sum = 0;
            for (int i = 0; i < 32; ++i) sum += q[i] = static_cast<int8_t>(std::nearbyint(v[i] * scale));
            out.s[b] = f16_round(amax / 127.0f * static_cast<float>(sum));
            out.sums[b] = static_cast<int16_t>(sum);
        } else {
            const float extreme = signed_extreme(v, 256);
            const float scale = extreme != 0.0f ? -127.0f / extreme : 0.0f;
            out.d[b] = extreme != 0.0f ? 1.0f / scale : 0.0f;
            for (int i = 0; i < 256; ++i) q[i] = static_cast<int8_t>(std::min(127.0f, std::nearbyint(v[i] * scale)));
            for (int g = 0; g < 16; ++g) {
                int sum = 0;
                for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
                out.sums[b * 16 + static_cast<size_t>(g)] = static_cast<int16_t>(sum);
            }
        }
    }
}

// ---- The integer dot: its definition, which every path computes to the bit ------------------------------------------
// A weight block is read 32 weights at a time (a chunk: one per Q8_0/Q4_*/Q5_* block, eight per K-quant block) as
// int8 values in the activations' order, each half of 16 with an integer scale (1 outside the K-quants). Per block,
// eight integer lanes, lane i holding columns 4i…4i+3 of every chunk times their half's scale:
//     lane_i = Σ_chunks scale · Σ_{k=4i..4i+3} q_w[k]·q_x[k]                       (exact in int32)
// then, block after block, sixteen float sums, even blocks in the first eight and odd ones in the others (two
// independent chains of multiply-adds, so one row's blocks need not wait for each other):
//     acc[8·(b mod 2) + i] = fma(d_w·d_x, lane_i, acc[8·(b mod 2) + i])
// and the minimums in one more:
//     Q4_1, Q5_1:        offset = fma(m, s_x, offset)                               (s_x = d_x·Σq_x, Q8_1's)
//     Q2_K, Q4_K, Q5_K:  offset = fma(−dmin·d_x, Σ_g min_g · Σ_{the 16 q_x of g}, offset)
// and the dot is fold_lanes(acc) + offset. The lanes are what AVX2's maddubs and madd leave in a register for 32
// bytes, so its twin keeps a row's sums in two registers from the first block to the last and folds once; every step
// that depends on order is in f32 and fixed, so the paths agree to the bit and a token's result never depends on its
// batch-mates.
//
// Q8_0, Q4_0, Q4_K and Q6_K (the types of Q8_0, Q4_0 and Q4_K_M files) are summed the other way, the way llama.cpp
// sums the rows it repacks: per block exact integers
//     Q8_0, Q4_0:  s = Σ_k q_w[k]·q_x[k]                     (Q4_0's q_w = nibble − 8)
//     Q4_K, Q6_K:  s = Σ_j sc_j·Σ_{k in sub-block j} q_w[k]·q_x[k]   (Q6_K's q_w = six bits − 32, sub-blocks of 16)
//     Q4_K:        mins = Σ_j m_j·(the sum of sub-block j's 32 q_x)
// and per row and token one chain over the blocks, acc = fma(d_w·d_x, s, acc), Q4_K's followed by
// acc = fma(−dmin·d_x, mins, acc), the dot being acc. A block's sum is one number, not eight lanes, so their rows can
// be stored interleaved sixteen at a time (row groups, below): one register then holds four columns of sixteen rows, and
// one multiply applies sixteen rows' scales.

// One weight block decoded for the integer dot.
struct IntegerBlock {
    int8_t q[256];      // the block's 32 or 256 weights as integers, in the activations' order
    int16_t scale[16];  // per 16 weights: the K-quants' sub-block scales (1 for the other types)
    int16_t min[16];    // per 16 weights: the minimums of Q2_K, Q4_K and Q5_K (0 otherwise)
    float d = 0;        // multiplies the lanes (with d_x)
    float m = 0;        // Q4_1, Q5_1: the minimum m added to each weight; Q2_K, Q4_K, Q5_K: dmin
};

constexpr bool integer_min_per_block(DType dtype) { return dtype == DType::Q4_1 || dtype == DType::Q5_1; }
constexpr bool integer_min_per_sub_block(DType dtype) {
    return dtype == DType::Q2_K || dtype == DType::Q4_K || dtype == DType::Q5_K;
}

// The layouts of the decoders above, read into integers instead of floats.
inline void decode_integer_block(DType dtype, const std::byte* b, IntegerBlock& u) {
    std::fill(std::begin(u.scale), std::end(u.scale), int16_t{1});
    std::fill(std::begin(u.min), std::end(u.min), int16_t{0});
    u.m = 0;
    int8_t* q = u.q;
    switch (dtype) {
        case DType::Q8_0:
            u.d = f16_at(b);
            std::memcpy(q, b + 2, 32);
            return;
        case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: {
            const bool with_min = integer_min_per_block(dtype), five_bits = dtype == DType::Q5_0 || dtype == DType::Q5_1;
            u.d = f16_at(b);
            if (with_min) u.m = f16_at(b + 2);
            uint32_t qh = 0;
            if (five_bits) std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
            const std::byte* qs = b + (with_min ? 4 : 2) + (five_bits ? 4 : 0);
            const int offset = with_min ? 0 : five_bits ? 16 : 8;
            for (int k = 0; k < 16; ++k) {
                q[k] = static_cast<int8_t>(((byte_at(qs, k) & 0x0F) | ((qh >> k) & 1) << 4) - offset);
                q[k + 16] = static_cast<int8_t>(((byte_at(qs, k) >> 4) | ((qh >> (k + 16)) & 1) << 4) - offset);
            }
            return;
        }
        case DType::Q2_K: case DType::Q3_K: {
            const bool three_bits = dtype == DType::Q3_K;
            const std::byte* qs = b + (three_bits ? 32 : 16);
            u.d = f16_at(b + (three_bits ? 108 : 80));
            if (!three_bits) u.m = f16_at(b + 82);
            for (int j = 0; j < 16; ++j) {
                if (three_bits) {  // 6-bit scales biased by 32: low nibbles in bytes 0–7, top two bits in bytes 8–11
                    const int low = j < 8 ? byte_at(b + 96, j) & 0x0F : byte_at(b + 96, j - 8) >> 4;
                    u.scale[j] = static_cast<int16_t>((low | ((byte_at(b + 104, j % 4) >> (2 * (j / 4))) & 3) << 4) - 32);
                } else {
                    u.scale[j] = static_cast<int16_t>(byte_at(b, j) & 0x0F);
                    u.min[j] = static_cast<int16_t>(byte_at(b, j) >> 4);
                }
            }
            for (int e = 0; e < 256; ++e) {
                const int i = e % 32, low = (byte_at(qs, 32 * (e / 128) + i) >> (2 * ((e % 128) / 32))) & 3;
                q[e] = static_cast<int8_t>(three_bits ? low - ((byte_at(b, i) >> (e / 32)) & 1 ? 0 : 4) : low);
            }
            return;
        }
        case DType::Q4_K: case DType::Q5_K: {
            const bool five_bits = dtype == DType::Q5_K;
            u.d = f16_at(b);
            u.m = f16_at(b + 2);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                k_scale_min(b + 4, j, sc, m);
                u.scale[2 * j] = u.scale[2 * j + 1] = static_cast<int16_t>(sc);
                u.min[2 * j] = u.min[2 * j + 1] = static_cast<int16_t>(m);
            }
            const std::byte* qs = b + (five_bits ? 48 : 16);
            for (int g = 0; g < 4; ++g)
                for (int l = 0; l < 32; ++l) {
                    const int fifth_low = five_bits ? ((byte_at(b + 16, l) >> (2 * g)) & 1) << 4 : 0;
                    const int fifth_high = five_bits ? ((byte_at(b + 16, l) >> (2 * g + 1)) & 1) << 4 : 0;
                    q[64 * g + l] = static_cast<int8_t>((byte_at(qs, 32 * g + l) & 0x0F) | fifth_low);
                    q[64 * g + 32 + l] = static_cast<int8_t>((byte_at(qs, 32 * g + l) >> 4) | fifth_high);
                }
            return;
        }
        case DType::Q6_K: {
            u.d = f16_at(b + 208);
            for (int j = 0; j < 16; ++j) u.scale[j] = static_cast<int8_t>(byte_at(b + 192, j));
            for (int e = 0; e < 256; ++e) {  // dequantize_q6_k's layout
                const int h = e / 128, r = e % 128, g = r / 32, l = r % 32;
                const int packed = byte_at(b, 64 * h + l + 32 * (g & 1));
                const int low = g < 2 ? packed & 0x0F : packed >> 4;
                q[e] = static_cast<int8_t>((low | ((byte_at(b + 128, 32 * h + l) >> (2 * g)) & 3) << 4) - 32);
            }
            return;
        }
        default: fail("no integer kernel for ", dtype_block(dtype).name, " weights");
    }
}

// One block's contribution to the sums of a token (sums[0..15] its half's lanes, sums[16] the offset): the
// definition above; `half` is the block's number mod 2.
inline void add_integer_block(DType dtype, const IntegerBlock& w, const QuantizedRows& x, size_t x_block, size_t half, float* sums) {
    const int B = x.block;
    const int8_t* xq = x.q.data() + x_block * static_cast<size_t>(B);
    int32_t lanes[8] = {};
    for (int k = 0; k < B; ++k) lanes[(k % 32) / 4] += w.scale[k / 16] * (w.q[k] * xq[k]);
    const float d = w.d * x.d[x_block];
    for (int i = 0; i < 8; ++i) sums[8 * half + i] = std::fma(d, static_cast<float>(lanes[i]), sums[8 * half + i]);
    if (integer_min_per_block(dtype)) sums[16] = std::fma(w.m, x.s[x_block], sums[16]);
    if (integer_min_per_sub_block(dtype)) {
        int32_t mins = 0;
        for (int g = 0; g < 16; ++g) mins += w.min[g] * x.sums[x_block * 16 + static_cast<size_t>(g)];
        sums[16] = std::fma(-(w.m * x.d[x_block]), static_cast<float>(mins), sums[16]);
    }
}

// The types summed in one chain, whose rows can be kept as row groups (dtype_blocks, section 02).
constexpr bool has_row_groups(DType dtype) { return dtype_block(dtype).row_groups; }

// One block's step of a row-group type's chain (the weights as decode_integer_block gives them: signed, with the
// K-quants' scale per 16 and Q4_K's minimums).
inline float add_grouped_block(DType dtype, const IntegerBlock& w, const QuantizedRows& x, size_t x_block, float acc) {
    const int B = x.block;
    const int8_t* xq = x.q.data() + x_block * static_cast<size_t>(B);
    int32_t s = 0;
    for (int k = 0; k < B; ++k) s += w.scale[k / 16] * (w.q[k] * xq[k]);
    acc = std::fma(w.d * x.d[x_block], static_cast<float>(s), acc);
    if (dtype == DType::Q4_K) {
        int32_t mins = 0;
        for (int g = 0; g < 16; ++g) mins += w.min[g] * x.sums[x_block * 16 + static_cast<size_t>(g)];
        acc = std::fma(-(w.m * x.d[x_block]), static_cast<float>(mins), acc);
    }
    return acc;
}

// Rows [row_begin, row_end) of out[T, N] against the T quantized tokens: each block decoded once, used by every token.
inline void matmul_rows_integer_portable(const Tensor& w, const QuantizedRows& x, int T, float* out, size_t row_begin,
                                         size_t row_end) {
    const size_t K = static_cast<size_t>(w.cols()), N = static_cast<size_t>(w.rows());
    const size_t blocks = K / static_cast<size_t>(x.block);
    const size_t block_bytes = static_cast<size_t>(dtype_block(w.dtype).bytes), row_bytes = blocks * block_bytes;
    thread_local std::vector<float> sums;  // [T, 17]: each token's sixteen lanes and offset (row-group types: one chain)
    IntegerBlock block;
    if (has_row_groups(w.dtype)) {
        for (size_t n = row_begin; n < row_end; ++n) {
            sums.assign(static_cast<size_t>(T), 0.0f);
            for (size_t b = 0; b < blocks; ++b) {
                decode_integer_block(w.dtype, w.data + n * row_bytes + b * block_bytes, block);
                for (int t = 0; t < T; ++t) sums[t] = add_grouped_block(w.dtype, block, x, static_cast<size_t>(t) * blocks + b, sums[t]);
            }
            for (int t = 0; t < T; ++t) out[static_cast<size_t>(t) * N + n] = sums[t];
        }
        return;
    }
    for (size_t n = row_begin; n < row_end; ++n) {
        sums.assign(static_cast<size_t>(T) * 17, 0.0f);
        for (size_t b = 0; b < blocks; ++b) {
            decode_integer_block(w.dtype, w.data + n * row_bytes + b * block_bytes, block);
            for (int t = 0; t < T; ++t) add_integer_block(w.dtype, block, x, static_cast<size_t>(t) * blocks + b, b % 2, &sums[t * 17]);
        }
        for (int t = 0; t < T; ++t) out[static_cast<size_t>(t) * N + n] = fold_lanes(&sums[t * 17]) + sums[t * 17 + 16];
    }
}

// ---- Row groups -----------------------------------------------------------------------------------------------------
// Rows 16g…16g + 15 of a Q8_0, Q4_0, Q4_K or Q6_K matrix side by side, so that one 64-byte load holds four columns of
// all sixteen rows: "column quad" m of a block (its weights 4m…4m + 3, in the activations' order) is stored as four
// bytes of row 0, four of row 1, … four of row 15. Per block, in order:
//     Q8_0 (544 bytes):   the 8 quads as int8 (8 × 64 bytes); the sixteen rows' f16 d (32 bytes)
//     Q4_0 (288 bytes):   4 × 64 bytes of the file's nibbles, whose low nibbles are quad m and high nibbles quad m + 4;
//                         the sixteen d
//     Q4_K (2368 bytes):  8 × 64 bytes for each pair of sub-blocks 2p, 2p + 1 (low nibbles: quad m of sub-block 2p;
//                         high: of 2p + 1); the 6-bit scales unpacked, sub-block j's sixteen at 2048 + 16j, the
//                         minimums at 2176 + 16j; the sixteen f16 d at 2304, dmin at 2336
//     Q6_K (3360 bytes):  per sub-block j of 16 weights (4 quads), 192 bytes: two registers of low four bits (quads
//                         4j and 4j + 1 in the low and high nibbles of the first, 4j + 2 and 4j + 3 of the second) and
//                         one of the top two bits (quad 4j + t in bits 2t, 2t + 1); the int8 scales at 3072 + 16j; d at
//                         3328
// The same bits as the file (the same bytes, but Q6_K's regrouped), rearranged once at load time (add_row_groups) or
// on the fly; rows past the matrix's end are zero.
constexpr size_t group_rows = 16;
constexpr size_t row_group_block_bytes(DType dtype) {
    switch (dtype) {
        case DType::Q8_0: return 544;
        case DType::Q4_0: return 288;
        case DType::Q4_K: return 2368;
        default: return 3360;  // Q6_K
    }
}
// Every layout ends with the sixteen f16 d (Q4_K: then the sixteen dmin).
constexpr size_t row_group_d_offset(DType dtype) { return row_group_block_bytes(dtype) - (dtype == DType::Q4_K ? 64 : 32); }

inline void interleave_row_group(DType dtype, const std::byte* matrix, size_t N, size_t blocks, size_t group, std::byte* out) {
    const size_t block_bytes = row_group_block_bytes(dtype), file_block_bytes = static_cast<size_t>(dtype_block(dtype).bytes);
    const size_t first = group * group_rows, rows = std::min(group_rows, N - first);
    if (rows < group_rows) std::memset(out, 0, blocks * block_bytes);
    for (size_t r = 0; r < rows; ++r)
        for (size_t b = 0; b < blocks; ++b) {
            const std::byte* from = matrix + ((first + r) * blocks + b) * file_block_bytes;
            std::byte* to = out + b * block_bytes;
            switch (dtype) {
                case DType::Q8_0:
                    for (size_t m = 0; m < 8; ++m) std::memcpy(to + 64 * m + 4 * r, from + 2 + 4 * m, 4);
                    std::memcpy(to + row_group_d_offset(dtype) + 2 * r, from, 2);
                    break;
                case DType::Q4_0:
                    for (size_t m = 0; m < 4; ++m) std::memcpy(to + 64 * m + 4 * r, from + 2 + 4 * m, 4);
                    std::memcpy(to + row_group_d_offset(dtype) + 2 * r, from, 2);
                    break;
                case DType::Q4_K:
                    for (size_t m = 0; m < 32; ++m) std::memcpy(to + 64 * m + 4 * r, from + 16 + 4 * m, 4);
                    for (int j = 0; j < 8; ++j) {
                        int sc, min;
                        k_scale_min(from + 4, j, sc, min);
                        to[2048 + 16 * j + r] = static_cast<std::byte>(sc);
                        to[2176 + 16 * j + r] = static_cast<std::byte>(min);
                    }
                    std::memcpy(to + row_group_d_offset(dtype) + 2 * r, from, 2);
                    std::memcpy(to + row_group_d_offset(dtype) + 32 + 2 * r, from + 2, 2);
                    break;
                default: {  // Q6_K: each weight as 0…63 (q + 32), then split again into four and two bits
                    IntegerBlock u;
                    decode_integer_block(dtype, from, u);
                    for (size_t j = 0; j < 16; ++j) {
                        std::byte* sub = to + 192 * j + 4 * r;
                        for (size_t t = 0; t < 4; ++t) {
                            auto bits = [&](size_t quad) { return static_cast<unsigned>(u.q[16 * j + 4 * quad + t] + 32); };
                            sub[t] = static_cast<std::byte>((bits(0) & 15) | (bits(1) & 15) << 4);
                            sub[64 + t] = static_cast<std::byte>((bits(2) & 15) | (bits(3) & 15) << 4);
                            sub[128 + t] = static_cast<std::byte>(bits(0) >> 4 | (bits(1) >> 4) << 2 | (bits(2) >> 4) << 4 | (bits(3) >> 4) << 6);
                        }
                        to[3072 + 16 * j + r] = static_cast<std::byte>(static_cast<int8_t>(u.scale[j]));
                    }
                    std::memcpy(to + row_group_d_offset(dtype) + 2 * r, from + 208, 2);
                }
            }
        }
}

// Every row-group matrix of the model once more as row groups, in one buffer: not zeroed first (every byte is
// written), and in 2 MB pages where Linux allows, so that filling it takes a few hundred page faults rather than a few
// hundred thousand. Threads fill it group by group from the mapping.
inline void add_row_groups(Model& model) {
    auto group_count = [](const Tensor& t) { return (static_cast<size_t>(t.rows()) + group_rows - 1) / group_rows; };
    auto group_bytes = [](const Tensor& t) {
        return static_cast<size_t>(t.cols()) / static_cast<size_t>(dtype_block(t.dtype).elements) * row_group_block_bytes(t.dtype);
    };
    std::vector<Tensor*> matrices = {&model.lm_head};
    for (LayerWeights& layer : model.layers)
        for (Tensor* t : layer.tensors()) matrices.push_back(t);
    std::erase_if(matrices, [](const Tensor* t) { return !has_row_groups(t->dtype) || t->empty() || t->shape.size() != 2; });
    if (matrices.empty()) return;
    size_t total = 0;
    for (const Tensor* t : matrices) total += group_count(*t) * group_bytes(*t);
    std::byte* start = nullptr;
    model.row_group_storage = huge_page_buffer(total, start);
    struct Job {
        const Tensor* tensor;
        std::byte* out;
        size_t group;
    };
    std::vector<Job> jobs;
    for (Tensor* t : matrices) {
        t->row_groups = start;
        for (size_t g = 0; g < group_count(*t); ++g) jobs.push_back({t, start + g * group_bytes(*t), g});
        start += group_count(*t) * group_bytes(*t);
    }
    std::atomic<size_t> next{0};
    auto work = [&] {
        for (size_t j; (j = next.fetch_add(1)) < jobs.size();) {
            const Tensor& t = *jobs[j].tensor;
            const size_t blocks = static_cast<size_t>(t.cols()) / static_cast<size_t>(dtype_block(t.dtype).elements);
            interleave_row_group(t.dtype, t.data, static_cast<size_t>(t.rows()), blocks, jobs[j].group, jobs[j].out);
        }
    };
    std::vector<std::thread> helpers(std::min(7u, std::max(1u, std::thread::hardware_concurrency()) - 1));
    for (std::thread& helper : helpers) helper = std::thread(work);
    work();
    for (std::thread& helper : helpers) helper.join();
}

#ifdef INFER_X86_KERNELS
// ---- The integer dot in AVX2 ----------------------------------------------------------------------------------------
// The same lanes and steps, with each row's sixteen float sums per token held in two registers (even and odd
// blocks) from the first block to the last, for the types without row groups: Q4_1, Q5_0, Q5_1 and Q5_K blocks are
// decoded straight into registers, 32 weights at a time; Q2_K and Q3_K blocks by the decoder above into an
// IntegerBlock on the stack. A
// block is decoded once per tile of C tokens, and each of its 32-weight chunks costs a token four instructions:
// maddubs multiplies unsigned by signed bytes and adds pairs into 16 bits (a signed weight's sign moves onto the
// activation), madd adds those pairs into the eight lanes, times the chunk's scales.

[[gnu::target("avx2,fma,f16c")]] inline float f16_at_avx2(const std::byte* p) {
    uint16_t half;
    std::memcpy(&half, p, 2);
    return _cvtsh_ss(half);  // the same value as f16_to_f32
}

[[gnu::target("avx2,fma,f16c")]] inline int32_t horizontal_sum_i32(__m256i v) {
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
    return _mm_cvtsi128_si32(sum);
}

// Bit k of `bits` as 0x10 in byte k: the fifth bits of a Q5_0/Q5_1 block (byte k/8 of the word spread over bytes
// 8·(k/8)…, then each byte keeps its own bit).
[[gnu::target("avx2,fma,f16c")]] inline __m256i fifth_bits_avx2(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// A Q4_1, Q5_0 or Q5_1 block's 32 weights as int8 (decode_integer_block's values).
template <DType dtype>
[[gnu::target("avx2,fma,f16c")]] inline __m256i chunk_avx2(const std::byte* b) {
    constexpr bool with_min = dtype == DType::Q4_1 || dtype == DType::Q5_1;
    constexpr bool five_bits = dtype == DType::Q5_0 || dtype == DType::Q5_1;
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (with_min ? 4 : 2) + (five_bits ? 4 : 0)));
    // Low nibbles are weights 0–15, high nibbles 16–31.
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
    if constexpr (five_bits) {
        uint32_t qh;
        std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
        q = _mm256_or_si256(q, fifth_bits_avx2(qh));
    }
    if constexpr (!with_min) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));  // Q5_0
    return q;
}

// The eight lanes of one 32-weight chunk against each of C tokens' activations (token c's at xq + c·stride), each
// half times its scale, added to lanes[c].
template <bool signed_weights, int C>
[[gnu::target("avx2,fma,f16c")]] inline void add_chunk_avx2(__m256i (&lanes)[C], __m256i q, __m256i scales, const int8_t* xq,
                                                             size_t stride) {
    const __m256i unsigned_q = signed_weights ? _mm256_sign_epi8(q, q) : q;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * stride));
        if constexpr (signed_weights) x = _mm256_sign_epi8(x, q);
        lanes[c] = _mm256_add_epi32(lanes[c], _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_q, x), scales));
    }
}

// A vector of int16 j (of the eight in each 128-bit half) for pshufb: broadcasts that int16 across its half.
[[gnu::target("avx2,fma,f16c")]] inline __m256i pick_int16(int low_half, int high_half) {
    return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((2 * high_half + 1) << 8 | 2 * high_half)),
                            _mm_set1_epi16(static_cast<int16_t>((2 * low_half + 1) << 8 | 2 * low_half)));
}

// The lanes of a K-quant block against C tokens, the block decoded in registers (Q5_K) or on the stack (Q2_K, Q3_K,
// through decode_integer_block); d, m and the sixteen minimums come back for the float step.
template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] inline void k_block_lanes_avx2(const std::byte* b, const int8_t* xq, size_t stride,
                                                                 __m256i (&lanes)[C], float& d, float& m, __m256i& mins) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if constexpr (dtype == DType::Q5_K) {
        d = f16_at_avx2(b);
        m = f16_at_avx2(b + 2);
        uint64_t scales, minimums;
        k_scales_and_mins(b + 4, scales, minimums);
        const __m128i min_bytes = _mm_cvtsi64_si128(static_cast<int64_t>(minimums));
        mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(min_bytes, min_bytes));  // one per 16 weights
        const __m256i scale16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(scales))));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)), one = _mm256_set1_epi8(1);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {  // 32 bytes: low nibbles are sub-block 2g, high nibbles 2g + 1; fifth bits from qh
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * g));
            const __m256i first = _mm256_or_si256(_mm256_and_si256(packed, low4),
                                                  _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
            const __m256i second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low4),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
            add_chunk_avx2<false, C>(lanes, first, _mm256_shuffle_epi8(scale16, pick_int16(2 * g, 2 * g)), xq + 64 * g, stride);
            add_chunk_avx2<false, C>(lanes, second, _mm256_shuffle_epi8(scale16, pick_int16(2 * g + 1, 2 * g + 1)), xq + 64 * g + 32,
                                     stride);
        }
    } else {
        IntegerBlock u;
        decode_integer_block(dtype, b, u);
        d = u.d;
        m = u.m;
        mins = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.min));
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
            add_chunk_avx2<dtype == DType::Q3_K, C>(lanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.q + 32 * j)),
                                                    _mm256_set_m128i(_mm_set1_epi16(u.scale[2 * j + 1]), _mm_set1_epi16(u.scale[2 * j])),
                                                    xq + 32 * j, stride);
    }
}

template <DType dtype>
constexpr bool is_k_quant = dtype == DType::Q2_K || dtype == DType::Q3_K || dtype == DType::Q4_K || dtype == DType::Q5_K ||
                            dtype == DType::Q6_K;

// Block b of a row against C tokens (token c's activation blocks at x_block + c·blocks): add_integer_block's steps
// into sums (the block's half) and offset.
template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] inline void add_block_avx2(const std::byte* block, const QuantizedRows& x, size_t x_block,
                                                             size_t blocks, size_t K, __m256 (&sums)[C], float (&offset)[C]) {
    constexpr int B = is_k_quant<dtype> ? 256 : 32;
    const int8_t* xq = x.q.data() + x_block * B;  // token c's at xq + c·K
    __m256i lanes[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) lanes[c] = _mm256_setzero_si256();
    float d, m = 0.0f;
    __m256i mins;
    if constexpr (is_k_quant<dtype>) {
        k_block_lanes_avx2<dtype, C>(block, xq, K, lanes, d, m, mins);
    } else {
        d = f16_at_avx2(block);
        if constexpr (integer_min_per_block(dtype)) m = f16_at_avx2(block + 2);
        constexpr bool signed_weights = dtype == DType::Q5_0;
        add_chunk_avx2<signed_weights, C>(lanes, chunk_avx2<dtype>(block), _mm256_set1_epi16(1), xq, K);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
        const size_t xb = x_block + c * blocks;
        sums[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[xb]), _mm256_cvtepi32_ps(lanes[c]), sums[c]);
        if constexpr (integer_min_per_block(dtype)) {
            offset[c] = std::fma(m, x.s[xb], offset[c]);
        } else if constexpr (integer_min_per_sub_block(dtype)) {
            const __m256i x_sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums.data() + xb * 16));
            const int32_t min_total = horizontal_sum_i32(_mm256_madd_epi16(mins, x_sums));
            offset[c] = std::fma(-(m * x.d[xb]), static_cast<float>(min_total), offset[c]);
        }
    }
}

// out[c·N + n] for the `rows` rows at `weights` and the C tokens from first_token on: two registers of eight sums
// per token, even blocks and odd blocks.
template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] void integer_tile_avx2(const std::byte* weights, size_t row_bytes, size_t rows,
                                                         const QuantizedRows& x, size_t first_token, size_t K, float* out,
                                                         size_t N) {
    const size_t blocks = K / (is_k_quant<dtype> ? 256 : 32), block_bytes = row_bytes / blocks;
    for (size_t n = 0; n < rows; ++n) {
        const std::byte* row = weights + n * row_bytes;
        __m256 even[C], odd[C];
        float offset[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm256_setzero_ps(), offset[c] = 0.0f;
        size_t b = 0;
        for (; b + 2 <= blocks; b += 2) {
            add_block_avx2<dtype, C>(row + b * block_bytes, x, first_token * blocks + b, blocks, K, even, offset);
            add_block_avx2<dtype, C>(row + (b + 1) * block_bytes, x, first_token * blocks + b + 1, blocks, K, odd, offset);
        }
        if (b < blocks) add_block_avx2<dtype, C>(row + b * block_bytes, x, first_token * blocks + b, blocks, K, even, offset);
        for (int c = 0; c < C; ++c) out[c * N + n] = horizontal_sum(_mm256_add_ps(even[c], odd[c])) + offset[c];
    }
}

// ---- Row groups in AVX2 and AVX-512 ---------------------------------------------------------------------------------
// Four bytes of a token's block, broadcast, meet a column quad of every row of the group at once: AVX-512's vpdpbusd
// adds the four products of each row into its own lane (sixteen rows a register), AVX2's maddubs adds pairs into 16
// bits (eight rows a register), widened by a madd. vpdpbusd multiplies unsigned weights by signed activations, so the
// weights enter as unsigned and their offset comes back through the activations' block sums as the register's
// starting value: Q8_0's q + 128 starts at −128·Σq_x, Q4_0's nibbles at −8·Σq_x, Q6_K's six bits at −32·Σq_x of each
// sub-block of 16. AVX2 keeps Q8_0 signed instead (maddubs' pairs of 255 · 127 would overflow 16 bits): its sign
// moves onto the activation. The K-quants' sub-block sums are multiplied by their rows' scales, and Q4_K's minimums
// meet the activations' sums of 16 in pairs (madd, or VNNI's vpdpwssd). Then per block and token one multiply of the
// rows' d_w by d_x and one multiply-add (Q4_K: two): the definition's chain in every lane at once. Every integer stays
// exact (16-bit sums at most 32512 before a madd widens them). Rows outside [lo, hi) of the group are not stored.

// AVX-512 row groups need VNNI; an AVX-512 CPU without it runs the AVX2 kernels (the same bits).
inline bool cpu_runs_integer_avx512() {
    static const bool vnni = cpu_supports(CpuKernels::Avx512) && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
    return vnni;
}

inline int32_t load_i32(const void* p) {
    int32_t value;
    std::memcpy(&value, p, 4);
    return value;
}
// Four activation bytes in every 32-bit lane; 32 bytes of a row group.
[[gnu::target("avx2,fma,f16c")]] inline __m256i broadcast4_avx2(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }
[[gnu::target("avx2,fma,f16c")]] inline __m256i load_avx2(const std::byte* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]] inline __m512i broadcast4_avx512(const int8_t* p) {
    return _mm512_set1_epi32(load_i32(p));
}
// A row group's per-row numbers: eight (AVX2) or sixteen (AVX-512) f16 widened to f32, or bytes widened to int32.
[[gnu::target("avx2,fma,f16c")]] inline __m256 f16_per_row_avx2(const std::byte* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]] inline __m512 f16_per_row_avx512(const std::byte* p) {
    return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <bool is_signed>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]] inline __m512i bytes_per_row_avx512(const std::byte* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return is_signed ? _mm512_maskz_cvtepi8_epi32(0xFFFF, bytes) : _mm512_maskz_cvtepu8_epi32(0xFFFF, bytes);
}

// How far ahead of the block in use the K-quant kernels request its lines from memory. A K-quant block is long work
// (2368 or 3360 bytes); at one token a tile the hardware prefetcher falls behind it, and decode waits on memory
// instead of running at its bandwidth. Q8_0 and Q4_0 blocks are short and already stream at the bandwidth, so they
// are not asked ahead by hand, which only slows them.
constexpr size_t prefetch_distance = 4096;

// A K-quant block's lines, requested from memory prefetch_distance ahead.
inline void prefetch_ahead(const std::byte* block, size_t bytes) {
    for (size_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(block + prefetch_distance + line), _MM_HINT_T0);
}

template <DType dtype>
constexpr int row_group_widest_tile(bool wide) {  // the K-quants keep a sub-block's sums per token besides the chain
    return dtype == DType::Q4_K || dtype == DType::Q6_K ? (wide ? 4 : 2) : (wide ? 8 : 4);
}

// Eight bytes of a row group, one per row, as int32 lanes holding the byte in both 16-bit halves (madd's pairs).
[[gnu::target("avx2,fma,f16c")]] inline __m256i twice_per_row_avx2(const std::byte* bytes) {
    const __m256i value = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    return _mm256_or_si256(value, _mm256_slli_epi32(value, 16));
}

template <DType dtype, int C>
[[gnu::target("avx2,fma,f16c")]] void row_group_avx2(const std::byte* group, size_t blocks, const QuantizedRows& x, size_t first_token,
                                                     size_t K, float* out, size_t N, size_t lo, size_t hi) {
    constexpr size_t B = dtype == DType::Q4_K || dtype == DType::Q6_K ? 256 : 32;
    const size_t block_bytes = row_group_block_bytes(dtype);
    const int8_t* xq = x.q.data() + first_token * K;  // token c's block b at xq + c·K + B·b
    const float* xd = x.d.data() + first_token * blocks;
    constexpr size_t sums_per_block = B == 256 ? 16 : 1;  // Q8_K's sums of 16, or one per block of 32
    const int16_t* xs = x.sums.data() + first_token * blocks * sums_per_block;
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    __m256 sums[2][C];  // rows 0…7 and 8…15, both halves of each block while its lines are in L1
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) sums[0][c] = sums[1][c] = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; ++b) {
        const std::byte* block = group + b * block_bytes;
        if constexpr (B == 256) prefetch_ahead(block, block_bytes);
        for (size_t half = 0; half < 2; ++half) {
            __m256 (&acc)[C] = sums[half];
            const std::byte* rows = block + 32 * half;  // quad m of these eight rows at rows + 64·m
            const int8_t* xb = xq + B * b;             // token c's block at xb + c·K
            auto block_sum = [&](int c, size_t j) { return static_cast<int>(xs[(c * blocks + b) * sums_per_block + j]); };
            __m256i s[C], mins[C];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) s[c] = mins[c] = _mm256_setzero_si256();
            if constexpr (dtype == DType::Q8_0) {
#pragma GCC unroll 8
                for (size_t m = 0; m < 8; ++m) {
                    const __m256i q = load_avx2(rows + 64 * m), magnitude = _mm256_sign_epi8(q, q);
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c) {
                        const __m256i signed_x = _mm256_sign_epi8(broadcast4_avx2(xb + c * K + 4 * m), q);
                        s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
                    }
                }
            } else if constexpr (dtype == DType::Q4_0) {
                __m256i pairs[C];
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) pairs[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (size_t m = 0; m < 4; ++m) {  // at most 8 · 2 · 15 · 127 = 30480 in 16 bits
                    const __m256i packed = load_avx2(rows + 64 * m);
                    const __m256i low = _mm256_and_si256(packed, low4), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c) {
                        pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(low, broadcast4_avx2(xb + c * K + 4 * m)));
                        pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(high, broadcast4_avx2(xb + c * K + 16 + 4 * m)));
                    }
                }
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) s[c] = _mm256_add_epi32(_mm256_madd_epi16(pairs[c], ones), _mm256_set1_epi32(-8 * block_sum(c, 0)));
            } else if constexpr (dtype == DType::Q4_K) {
                for (size_t p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high)
                    __m256i first[C], second[C];
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c) first[c] = second[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (size_t m = 0; m < 8; ++m) {
                        const __m256i packed = load_avx2(rows + 512 * p + 64 * m);
                        const __m256i low = _mm256_and_si256(packed, low4), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
#pragma GCC unroll 8
                        for (int c = 0; c < C; ++c) {
                            const int8_t* x = xb + c * K + 64 * p + 4 * m;  // sub-block 2p's quad m; 2p + 1's 32 on
                            first[c] = _mm256_add_epi16(first[c], _mm256_maddubs_epi16(low, broadcast4_avx2(x)));
                            second[c] = _mm256_add_epi16(second[c], _mm256_maddubs_epi16(high, broadcast4_avx2(x + 32)));
                        }
                    }
                    const __m256i scale_first = twice_per_row_avx2(block + 2048 + 16 * (2 * p) + 8 * half);
                    const __m256i scale_second = twice_per_row_avx2(block + 2048 + 16 * (2 * p + 1) + 8 * half);
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c)
                        s[c] = _mm256_add_epi32(s[c], _mm256_add_epi32(_mm256_madd_epi16(first[c], scale_first),
                                                                       _mm256_madd_epi16(second[c], scale_second)));
                }
#pragma GCC unroll 8
                for (size_t j = 0; j < 8; ++j) {
                    const __m256i minimum = twice_per_row_avx2(block + 2176 + 16 * j + 8 * half);
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c)
                        mins[c] = _mm256_add_epi32(mins[c], _mm256_madd_epi16(minimum, _mm256_set1_epi32(load_i32(
                                                                &xs[(c * blocks + b) * sums_per_block + 2 * j]))));
                }
            } else {  // Q6_K
#pragma GCC unroll 2
                for (size_t j = 0; j < 16; ++j) {
                    const __m256i first = load_avx2(rows + 192 * j), second = load_avx2(rows + 192 * j + 64);
                    const __m256i high = load_avx2(rows + 192 * j + 128);  // four quads' top two bits (0x30 once moved)
                    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(first, low4), _mm256_and_si256(_mm256_slli_epi16(high, 4), top2));
                    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(first, 4), low4),
                                                       _mm256_and_si256(_mm256_slli_epi16(high, 2), top2));
                    const __m256i q2 = _mm256_or_si256(_mm256_and_si256(second, low4), _mm256_and_si256(high, top2));
                    const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(second, 4), low4),
                                                       _mm256_and_si256(_mm256_srli_epi16(high, 2), top2));
                    const __m256i scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 3072 + 16 * j + 8 * half)));
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c) {  // pairs of quads: at most 2 · 2 · 63 · 127 = 32004 in 16 bits
                        const int8_t* x = xb + c * K + 16 * j;
                        const __m256i pair01 = _mm256_add_epi16(_mm256_maddubs_epi16(q0, broadcast4_avx2(x)), _mm256_maddubs_epi16(q1, broadcast4_avx2(x + 4)));
                        const __m256i pair23 = _mm256_add_epi16(_mm256_maddubs_epi16(q2, broadcast4_avx2(x + 8)), _mm256_maddubs_epi16(q3, broadcast4_avx2(x + 12)));
                        const __m256i sub = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(pair01, ones), _mm256_madd_epi16(pair23, ones)),
                                                             _mm256_set1_epi32(-32 * block_sum(c, j)));
                        s[c] = _mm256_add_epi32(s[c], _mm256_mullo_epi32(sub, scale));
                    }
                }
            }
            const __m256 d_w = f16_per_row_avx2(block + row_group_d_offset(dtype) + 16 * half);
            [[maybe_unused]] __m256 dmin_w;
            if constexpr (dtype == DType::Q4_K) dmin_w = f16_per_row_avx2(block + row_group_d_offset(dtype) + 32 + 16 * half);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                const __m256 d_x = _mm256_set1_ps(xd[c * blocks + b]);
                acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d_w, d_x), _mm256_cvtepi32_ps(s[c]), acc[c]);
                if constexpr (dtype == DType::Q4_K) acc[c] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin_w, d_x), _mm256_cvtepi32_ps(mins[c]), acc[c]);
            }
        }
    }
    for (size_t half = 0; half < 2; ++half) {
        const __m256i row = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(8 * half)));
        const __m256i keep = _mm256_and_si256(_mm256_cmpgt_epi32(row, _mm256_set1_epi32(static_cast<int>(lo) - 1)),
                                              _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(hi)), row));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) _mm256_maskstore_ps(out + c * N + 8 * half, keep, sums[half][c]);
    }
}

template <DType dtype, int C>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]] void row_group_avx512(const std::byte* group, size_t blocks,
                                                                                          const QuantizedRows& x, size_t first_token,
                                                                                          size_t K, float* out, size_t N, size_t lo,
                                                                                          size_t hi) {
    constexpr size_t B = dtype == DType::Q4_K || dtype == DType::Q6_K ? 256 : 32, sums_per_block = B == 256 ? 16 : 1;
    const size_t block_bytes = row_group_block_bytes(dtype);
    const int8_t* xq = x.q.data() + first_token * K;
    const float* xd = x.d.data() + first_token * blocks;
    const int16_t* xs = x.sums.data() + first_token * blocks * sums_per_block;
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 acc[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    for (size_t b = 0; b < blocks; ++b) {
        const std::byte* block = group + b * block_bytes;
        if constexpr (B == 256) prefetch_ahead(block, block_bytes);
        const int8_t* xb = xq + B * b;  // token c's block at xb + c·K
        auto block_sum = [&](int c, size_t j) { return static_cast<int>(xs[(c * blocks + b) * sums_per_block + j]); };
        __m512i s[C], mins[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            s[c] = mins[c] = _mm512_setzero_si512();
            if constexpr (dtype == DType::Q8_0) s[c] = _mm512_set1_epi32(-128 * block_sum(c, 0));
            if constexpr (dtype == DType::Q4_0) s[c] = _mm512_set1_epi32(-8 * block_sum(c, 0));
        }
        if constexpr (dtype == DType::Q8_0) {
#pragma GCC unroll 8
            for (size_t m = 0; m < 8; ++m) {
                const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * m), flip);  // q + 128 as unsigned
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) s[c] = _mm512_dpbusd_epi32(s[c], q, broadcast4_avx512(xb + c * K + 4 * m));
            }
        } else if constexpr (dtype == DType::Q4_0) {
#pragma GCC unroll 4
            for (size_t m = 0; m < 4; ++m) {
                const __m512i packed = _mm512_loadu_si512(block + 64 * m);
                const __m512i low = _mm512_and_si512(packed, low4), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) {
                    s[c] = _mm512_dpbusd_epi32(s[c], low, broadcast4_avx512(xb + c * K + 4 * m));
                    s[c] = _mm512_dpbusd_epi32(s[c], high, broadcast4_avx512(xb + c * K + 16 + 4 * m));
                }
            }
        } else if constexpr (dtype == DType::Q4_K) {
            for (size_t p = 0; p < 4; ++p) {
                __m512i first[C], second[C];
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) first[c] = second[c] = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (size_t m = 0; m < 8; ++m) {
                    const __m512i packed = _mm512_loadu_si512(block + 512 * p + 64 * m);
                    const __m512i low = _mm512_and_si512(packed, low4), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
#pragma GCC unroll 8
                    for (int c = 0; c < C; ++c) {
                        const int8_t* x = xb + c * K + 64 * p + 4 * m;
                        first[c] = _mm512_dpbusd_epi32(first[c], low, broadcast4_avx512(x));
                        second[c] = _mm512_dpbusd_epi32(second[c], high, broadcast4_avx512(x + 32));
                    }
                }
                const __m512i scale_first = bytes_per_row_avx512<false>(block + 2048 + 16 * (2 * p));
                const __m512i scale_second = bytes_per_row_avx512<false>(block + 2048 + 16 * (2 * p + 1));
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c)
                    s[c] = _mm512_add_epi32(s[c], _mm512_add_epi32(_mm512_mullo_epi32(first[c], scale_first),
                                                                   _mm512_mullo_epi32(second[c], scale_second)));
            }
#pragma GCC unroll 8
            for (size_t j = 0; j < 8; ++j) {
                const __m512i value = bytes_per_row_avx512<false>(block + 2176 + 16 * j);
                const __m512i minimum = _mm512_or_si512(value, _mm512_maskz_slli_epi32(0xFFFF, value, 16));
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c)
                    mins[c] = _mm512_dpwssd_epi32(mins[c], minimum, _mm512_set1_epi32(load_i32(&xs[(c * blocks + b) * sums_per_block + 2 * j])));
            }
        } else {  // Q6_K
#pragma GCC unroll 2
            for (size_t j = 0; j < 16; ++j) {
                const __m512i first = _mm512_loadu_si512(block + 192 * j), second = _mm512_loadu_si512(block + 192 * j + 64);
                const __m512i high = _mm512_loadu_si512(block + 192 * j + 128);
                const __m512i q0 = _mm512_or_si512(_mm512_and_si512(first, low4), _mm512_and_si512(_mm512_slli_epi16(high, 4), top2));
                const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(first, 4), low4),
                                                   _mm512_and_si512(_mm512_slli_epi16(high, 2), top2));
                const __m512i q2 = _mm512_or_si512(_mm512_and_si512(second, low4), _mm512_and_si512(high, top2));
                const __m512i q3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(second, 4), low4),
                                                   _mm512_and_si512(_mm512_srli_epi16(high, 2), top2));
                const __m512i scale = bytes_per_row_avx512<true>(block + 3072 + 16 * j);
#pragma GCC unroll 8
                for (int c = 0; c < C; ++c) {
                    __m512i sub = _mm512_set1_epi32(-32 * block_sum(c, j));
                    sub = _mm512_dpbusd_epi32(sub, q0, broadcast4_avx512(xb + c * K + 16 * j));
                    sub = _mm512_dpbusd_epi32(sub, q1, broadcast4_avx512(xb + c * K + 16 * j + 4));
                    sub = _mm512_dpbusd_epi32(sub, q2, broadcast4_avx512(xb + c * K + 16 * j + 8));
                    sub = _mm512_dpbusd_epi32(sub, q3, broadcast4_avx512(xb + c * K + 16 * j + 12));
                    s[c] = _mm512_add_epi32(s[c], _mm512_mullo_epi32(sub, scale));
                }
            }
        }
        const __m512 d_w = f16_per_row_avx512(block + row_group_d_offset(dtype));
        [[maybe_unused]] __m512 dmin_w;
        if constexpr (dtype == DType::Q4_K) dmin_w = f16_per_row_avx512(block + row_group_d_offset(dtype) + 32);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
            const __m512 d_x = _mm512_set1_ps(xd[c * blocks + b]);
            acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(d_w, d_x), _mm512_maskz_cvtepi32_ps(0xFFFF, s[c]), acc[c]);
            if constexpr (dtype == DType::Q4_K)
                acc[c] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin_w, d_x), _mm512_maskz_cvtepi32_ps(0xFFFF, mins[c]), acc[c]);
        }
    }
    const __mmask16 keep = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + c * N, keep, acc[c]);
}

// Rows [row_begin, row_end) of a row-group matrix, group by group (interleaved here when the tensor has no row groups
// of its own), every tile of tokens passing over a group while it sits in L1 or L2, the tiles as wide as the
// registers allow.
template <DType dtype, bool wide>
void row_group_rows(const Tensor& w, const QuantizedRows& x, int T, float* out, size_t row_begin, size_t row_end) {
    const size_t K = static_cast<size_t>(w.cols()), N = static_cast<size_t>(w.rows()), blocks = K / static_cast<size_t>(x.block);
    const size_t group_bytes = blocks * row_group_block_bytes(dtype), tokens = static_cast<size_t>(T);
    constexpr int widest = row_group_widest_tile<dtype>(wide);
    thread_local std::vector<std::byte> interleaved;
    for (size_t g = row_begin / group_rows; g * group_rows < row_end; ++g) {
        const std::byte* group;
        if (w.row_groups) {
            group = w.row_groups + g * group_bytes;
        } else {
            interleaved.resize(group_bytes);
            interleave_row_group(dtype, w.data, N, blocks, g, interleaved.data());
            group = interleaved.data();
        }
        const size_t first = g * group_rows, lo = std::max(row_begin, first) - first, hi = std::min(row_end, first + group_rows) - first;
        auto tile = [&]<int C>(size_t t) {
            if constexpr (wide) row_group_avx512<dtype, C>(group, blocks, x, t, K, out + t * N + first, N, lo, hi);
            else row_group_avx2<dtype, C>(group, blocks, x, t, K, out + t * N + first, N, lo, hi);
        };
        size_t t = 0;
        if constexpr (widest >= 8)
            for (; t + 8 <= tokens; t += 8) tile.template operator()<8>(t);
        if constexpr (widest >= 4)
            for (; t + 4 <= tokens; t += 4) tile.template operator()<4>(t);
        for (; t + 2 <= tokens; t += 2) tile.template operator()<2>(t);
        if (t < tokens) tile.template operator()<1>(t);
    }
}

// Rows [row_begin, row_end) of the other types, in blocks of about 256 KB that stay in L2 while every tile of tokens
// passes over them (4 tokens a tile in AVX2's 16 registers, then smaller tiles for the rest).
template <DType dtype>
void integer_rows_avx2(const Tensor& w, const QuantizedRows& x, int T, float* out, size_t row_begin, size_t row_end) {
    const size_t K = static_cast<size_t>(w.cols()), N = static_cast<size_t>(w.rows());
    const size_t row_bytes = static_cast<size_t>(dtype_bytes(dtype, static_cast<int64_t>(K)));
    const size_t rows_per_block = std::max<size_t>(1, (size_t{256} << 10) / row_bytes), tokens = static_cast<size_t>(T);
    for (size_t block = row_begin; block < row_end; block += rows_per_block) {
        const std::byte* rows = w.data + block * row_bytes;
        const size_t count = std::min(row_end, block + rows_per_block) - block;
        size_t t = 0;
        for (; t + 4 <= tokens; t += 4) integer_tile_avx2<dtype, 4>(rows, row_bytes, count, x, t, K, out + t * N + block, N);
        for (; t + 2 <= tokens; t += 2) integer_tile_avx2<dtype, 2>(rows, row_bytes, count, x, t, K, out + t * N + block, N);
        if (t < tokens) integer_tile_avx2<dtype, 1>(rows, row_bytes, count, x, t, K, out + t * N + block, N);
    }
}

template <DType dtype>
void integer_rows_simd(CpuKernels path, const Tensor& w, const QuantizedRows& x, int T, float* out, size_t row_begin, size_t row_end) {
    if constexpr (has_row_groups(dtype)) {
        if (path == CpuKernels::Avx512 && cpu_runs_integer_avx512()) row_group_rows<dtype, true>(w, x, T, out, row_begin, row_end);
        else row_group_rows<dtype, false>(w, x, T, out, row_begin, row_end);
    } else {
        integer_rows_avx2<dtype>(w, x, T, out, row_begin, row_end);
    }
}

inline void matmul_rows_integer_simd(CpuKernels path, const Tensor& w, const QuantizedRows& x, int T, float* out, size_t row_begin,
                                     size_t row_end) {
    switch (w.dtype) {
        case DType::Q8_0: return integer_rows_simd<DType::Q8_0>(path, w, x, T, out, row_begin, row_end);
        case DType::Q4_0: return integer_rows_simd<DType::Q4_0>(path, w, x, T, out, row_begin, row_end);
        case DType::Q4_1: return integer_rows_simd<DType::Q4_1>(path, w, x, T, out, row_begin, row_end);
        case DType::Q5_0: return integer_rows_simd<DType::Q5_0>(path, w, x, T, out, row_begin, row_end);
        case DType::Q5_1: return integer_rows_simd<DType::Q5_1>(path, w, x, T, out, row_begin, row_end);
        case DType::Q2_K: return integer_rows_simd<DType::Q2_K>(path, w, x, T, out, row_begin, row_end);
        case DType::Q3_K: return integer_rows_simd<DType::Q3_K>(path, w, x, T, out, row_begin, row_end);
        case DType::Q4_K: return integer_rows_simd<DType::Q4_K>(path, w, x, T, out, row_begin, row_end);
        case DType::Q5_K: return integer_rows_simd<DType::Q5_K>(path, w, x, T, out, row_begin, row_end);
        case DType::Q6_K: return integer_rows_simd<DType::Q6_K>(path, w, x, T, out, row_begin, row_end);
        default: fail("no integer kernel for ", dtype_block(w.dtype).name, " weights");
    }
}
#endif

inline void matmul_rows_integer(CpuKernels path, const Tensor& w, const QuantizedRows& x, int T, float* out, size_t row_begin,
                                size_t row_end) {
#ifdef INFER_X86_KERNELS
    if (path != CpuKernels::Portable) return matmul_rows_integer_simd(path, w, x, T, out, row_begin, row_end);
#endif
    matmul_rows_integer_portable(w, x, T, out, row_begin, row_end);
}

}  // namespace detail

// ==== I QUANTIZING ===================================================================================================
// `infer quantize`: a float GGUF (F32, F16 or BF16 weights), or a Hugging Face folder converted on the way, written
// with its matrices in blocks. Each encoder is the inverse of a decoder of appendix H. Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1
// follow llama.cpp's reference rounding step for step, so their bytes are identical to llama-quantize's for the same
// input; the K-quants search each sub-block's scale and minimum by least squares over a few candidate grids (their own
// search, judged by the error it leaves). A recipe such as Q4_K_M gives a few sensitive matrices more bits. Cost: one
// pass over the weights, a few dozen operations per weight for the K-quants' search; a 1B model takes seconds per thread.

namespace detail {


// Q8_0: d = max|x| / 127 (stored as f16), q = round(x · (1/d)), ties away from zero: the reference's exact order.
inline void quantize_q8_0(const float* x, std::byte* b) {
    float amax = 0.0f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    for (int k = 0; k < 32; ++k) b[2 + k] = static_cast<std::byte>(static_cast<int8_t>(std::round(x[k] * inverse)));
}

// Q4_0 / Q5_0: d = extreme / −8 (−16), q = min(top, trunc(x/d + half_range + 0.5)). Q4_1 / Q5_1: d = (max − min) /
// top, m = min, q = trunc((x − min)/d + 0.5). `bits` is 4 or 5; the fifth bits go to qh as the decoder reads them.
inline void quantize_q45_0_1(const float* x, std::byte* b, int bits, bool with_min) {
    const int top = (1 << bits) - 1;
    float d = 0.0f, m = 0.0f;
    if (with_min) {
        float lo = std::numeric_limits<float>::max(), hi = -std::numeric_limits<float>::max();
        for (int k = 0; k < 32; ++k) {
            lo = std::min(lo, x[k]);
            hi = std::max(hi, x[k]);
        }
        d = (hi - lo) / static_cast<float>(top);
        m = lo;
    } else {
        d = signed_extreme(x, 32) / -static_cast<float>(1 << (bits - 1));
    }
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    if (with_min) put_f16(b + 2, m);
    const float bias = with_min ? 0.5f : static_cast<float>(1 << (bits - 1)) + 0.5f;
    uint32_t qh = 0;
    std::byte* qs = b + (with_min ? 4 : 2) + (bits == 5 ? 4 : 0);
    for (int k = 0; k < 16; ++k) {
        const float low = with_min ? (x[k] - m) * inverse : x[k] * inverse;
        const float high = with_min ? (x[k + 16] - m) * inverse : x[k + 16] * inverse;
        const int q0 = std::min(top, static_cast<int>(static_cast<int8_t>(low + bias)));
        const int q1 = std::min(top, static_cast<int>(static_cast<int8_t>(high + bias)));
        qs[k] = static_cast<std::byte>((q0 & 0x0F) | (q1 & 0x0F) << 4);
        qh |= static_cast<uint32_t>((q0 >> 4) & 1) << k | static_cast<uint32_t>((q1 >> 4) & 1) << (k + 16);
    }
    if (bits == 5) std::memcpy(b + (with_min ? 4 : 2), &qh, 4);
}

// The best x ≈ scale·q − offset for one sub-block, q in 0…top and offset ≥ 0 (what Q4_K and Q5_K store per 32
// weights before those two numbers are themselves quantized): for a few grid spacings around (max − min)/top, round
// every x to the grid, fit scale and offset to those q by least squares, and keep the fit with the least error.
struct AffineFit {
    float scale = 0.0f, offset = 0.0f;
};
inline float affine_error(const float* x, int n, int top, float scale, float offset) {
    float error = 0.0f;
    for (int i = 0; i < n; ++i) {
        const int q = scale > 0 ? std::clamp(static_cast<int>(std::nearbyint((x[i] + offset) / scale)), 0, top) : 0;
        const float e = scale * static_cast<float>(q) - offset - x[i];
        error += e * e;
    }
    return error;
}
inline AffineFit fit_affine(const float* x, int n, int top) {
    float lo = 0.0f, hi = x[0];
    for (int i = 0; i < n; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
    }
    AffineFit best{hi > lo ? (hi - lo) / static_cast<float>(top) : 0.0f, -lo};
    if (hi <= lo) return best;
    float best_error = affine_error(x, n, top, best.scale, best.offset);
    for (int step = -6; step <= 12; ++step) {
        const float grid = (static_cast<float>(top) + 0.1f * static_cast<float>(step)) / (hi - lo);
        double sum_q = 0, sum_qq = 0, sum_x = 0, sum_xq = 0;
        for (int i = 0; i < n; ++i) {
            const double q = std::clamp(static_cast<int>(std::nearbyint((x[i] - lo) * grid)), 0, top);
            sum_q += q;
            sum_qq += q * q;
            sum_x += x[i];
            sum_xq += x[i] * q;
        }
        const double det = n * sum_qq - sum_q * sum_q;
        if (det <= 0) continue;
        double scale = (n * sum_xq - sum_q * sum_x) / det, shift = (sum_qq * sum_x - sum_q * sum_xq) / det;
        if (shift > 0) {  // the offset is stored as a non-negative minimum: pin it at 0 and refit the scale alone
            shift = 0;
            scale = sum_xq / sum_qq;
        }
        if (scale <= 0) continue;
        const float error = affine_error(x, n, top, static_cast<float>(scale), static_cast<float>(-shift));
        if (error < best_error) {
            best_error = error;
            best = {static_cast<float>(scale), static_cast<float>(-shift)};
        }
    }
    return best;
}

// Q4_K (bits 4) and Q5_K (bits 5): eight sub-blocks of 32, each fitted alone; then the eight scales and the eight
// offsets are stored as 6-bit multiples of the block's d and dmin (f16), and every q is rounded again against the
// values the decoder will actually use, (d·sc) and (dmin·m).
inline void quantize_q45_k(const float* x, std::byte* b, int bits) {
    const int top = (1 << bits) - 1;
    AffineFit fits[8];
    float max_scale = 0.0f, max_offset = 0.0f;
    for (int j = 0; j < 8; ++j) {
        fits[j] = fit_affine(x + 32 * j, 32, top);
        max_scale = std::max(max_scale, fits[j].scale);
        max_offset = std::max(max_offset, fits[j].offset);
    }
    const float d = f16_round(max_scale / 63.0f), dmin = f16_round(max_offset / 63.0f);
    put_f16(b, d);
    put_f16(b + 2, dmin);
    std::byte* scales = b + 4;
    std::memset(scales, 0, 12);
    uint8_t q[256];
    for (int j = 0; j < 8; ++j) {
        const int sc = d > 0 ? std::clamp(static_cast<int>(std::nearbyint(fits[j].scale / d)), 0, 63) : 0;
        const int m = dmin > 0 ? std::clamp(static_cast<int>(std::nearbyint(fits[j].offset / dmin)), 0, 63) : 0;
        if (j < 4) {
            scales[j] |= static_cast<std::byte>(sc);
            scales[j + 4] |= static_cast<std::byte>(m);
        } else {
            scales[j + 4] = static_cast<std::byte>((sc & 0x0F) | (m & 0x0F) << 4);
            scales[j - 4] |= static_cast<std::byte>((sc >> 4) << 6);
            scales[j] |= static_cast<std::byte>((m >> 4) << 6);
        }
        const float step = d * static_cast<float>(sc), offset = dmin * static_cast<float>(m);
        for (int i = 0; i < 32; ++i) {
            const float value = x[32 * j + i];
            q[32 * j + i] = static_cast<uint8_t>(step > 0 ? std::clamp(static_cast<int>(std::nearbyint((value + offset) / step)), 0, top) : 0);
        }
    }
    std::byte* qh = b + 16;
    std::byte* qs = b + (bits == 5 ? 48 : 16);
    if (bits == 5) std::memset(qh, 0, 32);
    for (int g = 0; g < 4; ++g)
        for (int l = 0; l < 32; ++l) {
            const int low = q[64 * g + l], high = q[64 * g + 32 + l];
            qs[32 * g + l] = static_cast<std::byte>((low & 0x0F) | (high & 0x0F) << 4);
            if (bits == 5) qh[l] |= static_cast<std::byte>(((low >> 4) & 1) << (2 * g) | ((high >> 4) & 1) << (2 * g + 1));
        }
}

// The best x ≈ scale·q for one sub-block, q in low…high (symmetric types: Q3_K, Q6_K): the scale that puts the
// sub-block's extreme on `low`, refined by least squares over a few grids around it.
inline float fit_symmetric(const float* xs, int n, int low, int high) {
    const float extreme = signed_extreme(xs, n);
    float best_scale = extreme / static_cast<float>(low), best_error = std::numeric_limits<float>::max();
    for (int step = -6; step <= 6 && extreme != 0.0f; ++step) {
        const float grid = (static_cast<float>(low) + 0.1f * static_cast<float>(step)) / extreme;
        double sum_xq = 0, sum_qq = 0;
        for (int i = 0; i < n; ++i) {
            const double q = std::clamp(static_cast<int>(std::nearbyint(xs[i] * grid)), low, high);
            sum_xq += xs[i] * q;
            sum_qq += q * q;
        }
        if (sum_qq <= 0) continue;
        const float scale = static_cast<float>(sum_xq / sum_qq);
        float error = 0.0f;
        for (int i = 0; i < n; ++i) {
            const int q = std::clamp(static_cast<int>(std::nearbyint(xs[i] / scale)), low, high);
            error += (scale * static_cast<float>(q) - xs[i]) * (scale * static_cast<float>(q) - xs[i]);
        }
        if (error < best_error) {
            best_error = error;
            best_scale = scale;
        }
    }
    return best_scale;
}

// Q6_K: sixteen sub-blocks of 16, symmetric, q in −32…31, each scale fitted by fit_symmetric; the scales are stored
// as int8 multiples of d (f16), and every q is rounded again against d·scale.
inline void quantize_q6_k(const float* x, std::byte* b) {
    float fitted[16], max_abs = 0.0f;
    for (int j = 0; j < 16; ++j) {
        fitted[j] = fit_symmetric(x + 16 * j, 16, -32, 31);
        max_abs = std::max(max_abs, std::fabs(fitted[j]));
    }
    const float d = f16_round(max_abs / 127.0f);
    std::byte* ql = b;
    std::byte* qh = b + 128;
    std::byte* scales = b + 192;
    std::memset(b, 0, 192);
    for (int j = 0; j < 16; ++j) {
        const int sc = d > 0 ? std::clamp(static_cast<int>(std::nearbyint(fitted[j] / d)), -127, 127) : 0;
        scales[j] = static_cast<std::byte>(static_cast<int8_t>(sc));
        const float step = d * static_cast<float>(sc);
        for (int i = 0; i < 16; ++i) {
            const int e = 16 * j + i;
            const int q = step != 0.0f ? std::clamp(static_cast<int>(std::nearbyint(x[e] / step)), -32, 31) : 0;
            const int u = q + 32, h = e / 128, r = e % 128, g = r / 32, l = r % 32;
            ql[64 * h + l + 32 * (g & 1)] |= static_cast<std::byte>(g < 2 ? (u & 0x0F) : (u & 0x0F) << 4);
            qh[32 * h + l] |= static_cast<std::byte>((u >> 4) << (2 * g));
        }
    }
    put_f16(b + 208, d);
}

// Q2_K: sixteen sub-blocks of 16, each fitted as x ≈ scale·q − offset with q in 0…3 (fit_affine); the scales and
// offsets are stored as 4-bit multiples of the block's d and dmin (f16), and every q is rounded again against them.
// The layout is dequantize_q2_k's: weight e's two bits sit in qs[32·(e/128) + e%32] at bit 2·((e%128)/32).
inline void quantize_q2_k(const float* x, std::byte* b) {
    AffineFit fits[16];
    float max_scale = 0.0f, max_offset = 0.0f;
    for (int j = 0; j < 16; ++j) {
        fits[j] = fit_affine(x + 16 * j, 16, 3);
        max_scale = std::max(max_scale, fits[j].scale);
        max_offset = std::max(max_offset, fits[j].offset);
    }
    const float d = f16_round(max_scale / 15.0f), dmin = f16_round(max_offset / 15.0f);
    std::memset(b, 0, 84);
    for (int j = 0; j < 16; ++j) {
        const int sc = d > 0 ? std::clamp(static_cast<int>(std::nearbyint(fits[j].scale / d)), 0, 15) : 0;
        const int m = dmin > 0 ? std::clamp(static_cast<int>(std::nearbyint(fits[j].offset / dmin)), 0, 15) : 0;
        b[j] = static_cast<std::byte>(sc | m << 4);
        const float step = d * static_cast<float>(sc), offset = dmin * static_cast<float>(m);
        for (int i = 0; i < 16; ++i) {
            const int e = 16 * j + i;
            const int q = step > 0 ? std::clamp(static_cast<int>(std::nearbyint((x[e] + offset) / step)), 0, 3) : 0;
            b[16 + 32 * (e / 128) + e % 32] |= static_cast<std::byte>(q << (2 * ((e % 128) / 32)));
        }
    }
    put_f16(b + 80, d);
    put_f16(b + 82, dmin);
}

// Q3_K: sixteen sub-blocks of 16, symmetric, q in −4…3 (fit_symmetric). The scale of largest magnitude sets d (f16):
// it becomes exactly −32·d, the most negative 6-bit code; the others are rounded multiples of d, and every q is
// rounded again against d·scale. q + 4 splits into two low bits (qs, as in Q2_K) and a third bit (hmask[e%32], bit
// e/32); the scales' low nibbles fill bytes 0–7, their top two bits bytes 8–11 (dequantize_q3_k's layout).
inline void quantize_q3_k(const float* x, std::byte* b) {
    float fitted[16], largest = 0.0f;
    for (int j = 0; j < 16; ++j) {
        fitted[j] = fit_symmetric(x + 16 * j, 16, -4, 3);
        if (std::fabs(fitted[j]) > std::fabs(largest)) largest = fitted[j];
    }
    const float d = f16_round(largest / -32.0f);
    std::memset(b, 0, 110);
    std::byte* hmask = b;
    std::byte* qs = b + 32;
    std::byte* scales = b + 96;
    for (int j = 0; j < 16; ++j) {
        const int sc = d != 0 ? std::clamp(static_cast<int>(std::nearbyint(fitted[j] / d)), -32, 31) : 0;
        const int u = sc + 32;
        scales[j < 8 ? j : j - 8] |= static_cast<std::byte>(j < 8 ? (u & 0x0F) : (u & 0x0F) << 4);
        scales[8 + j % 4] |= static_cast<std::byte>((u >> 4) << (2 * (j / 4)));
        const float step = d * static_cast<float>(sc);
        for (int i = 0; i < 16; ++i) {
            const int e = 16 * j + i;
            const int q = step != 0.0f ? std::clamp(static_cast<int>(std::nearbyint(x[e] / step)), -4, 3) : 0;
            const int code = q + 4;
            qs[32 * (e / 128) + e % 32] |= static_cast<std::byte>((code & 3) << (2 * ((e % 128) / 32)));
            if (code >> 2) hmask[e % 32] |= static_cast<std::byte>(1 << (e / 32));
        }
    }
    put_f16(b + 108, d);
}

}  // namespace detail

// `count` f32 weights (a whole number of blocks) into blocks of `dtype`: the inverse of dequantize_row.
inline void quantize_row(DType dtype, const float* x, std::byte* blocks, int64_t count) {
    const DTypeBlock& block = dtype_block(dtype);
    for (int64_t i = 0; i < count; i += block.elements, x += block.elements, blocks += block.bytes) {
        switch (dtype) {
            case DType::F32: std::memcpy(blocks, x, 4); break;
            case DType::F16: detail::put_f16(blocks, x[0]); break;
            case DType::BF16: {
                const uint16_t half = f32_to_bf16(x[0]);
                std::memcpy(blocks, &half, 2);
                break;
            }
            case DType::Q8_0: detail::quantize_q8_0(x, blocks); break;
            case DType::Q4_0: detail::quantize_q45_0_1(x, blocks, 4, false); break;
            case DType::Q4_1: detail::quantize_q45_0_1(x, blocks, 4, true); break;
            case DType::Q5_0: detail::quantize_q45_0_1(x, blocks, 5, false); break;
            case DType::Q5_1: detail::quantize_q45_0_1(x, blocks, 5, true); break;
            case DType::Q4_K: detail::quantize_q45_k(x, blocks, 4); break;
            case DType::Q5_K: detail::quantize_q45_k(x, blocks, 5); break;
            case DType::Q6_K: detail::quantize_q6_k(x, blocks); break;
            case DType::Q2_K: detail::quantize_q2_k(x, blocks); break;
            case DType::Q3_K: detail::quantize_q3_k(x, blocks); break;
        }
    }
}

// A quantization recipe: the type most matrices get, and the exceptions llama.cpp's recipes of the same name make.
// The classifier (output.weight, or the embedding when it is tied) is the tensor most sensitive to rounding, so it
// gets `output`; the _M and _S recipes give attn_v and ffn_down more bits in some layers (`boosted`): the _M ones in the
// first and last eighth of the layers and every third layer between, the _S ones in the first eighth only.
struct QuantRecipe {
    const char* name;
    int file_type;  // general.file_type, llama.cpp's numbering
    DType base, output, boosted;
    enum class Boost { None, Medium, Small } boost = Boost::None;
};

inline const std::vector<QuantRecipe>& quant_recipes() {
    using B = QuantRecipe::Boost;
    static const std::vector<QuantRecipe> recipes = {
        {"F32", 0, DType::F32, DType::F32, DType::F32},        {"F16", 1, DType::F16, DType::F16, DType::F16},
        {"BF16", 32, DType::BF16, DType::BF16, DType::BF16},   {"Q8_0", 7, DType::Q8_0, DType::Q8_0, DType::Q8_0},
        {"Q4_0", 2, DType::Q4_0, DType::Q6_K, DType::Q4_0},    {"Q4_1", 3, DType::Q4_1, DType::Q6_K, DType::Q4_1},
        {"Q5_0", 8, DType::Q5_0, DType::Q6_K, DType::Q5_0},    {"Q5_1", 9, DType::Q5_1, DType::Q6_K, DType::Q5_1},
        {"Q2_K", 10, DType::Q2_K, DType::Q6_K, DType::Q4_K, B::Small},
        {"Q3_K_S", 11, DType::Q3_K, DType::Q6_K, DType::Q3_K},
        {"Q3_K_M", 12, DType::Q3_K, DType::Q6_K, DType::Q4_K, B::Medium},
        {"Q3_K_L", 13, DType::Q3_K, DType::Q6_K, DType::Q5_K, B::Medium},
        {"Q4_K_S", 14, DType::Q4_K, DType::Q6_K, DType::Q5_K, B::Small},
        {"Q4_K_M", 15, DType::Q4_K, DType::Q6_K, DType::Q6_K, B::Medium},
        {"Q5_K_S", 16, DType::Q5_K, DType::Q6_K, DType::Q6_K, B::Small},
        {"Q5_K_M", 17, DType::Q5_K, DType::Q6_K, DType::Q6_K, B::Medium},
        {"Q6_K", 18, DType::Q6_K, DType::Q6_K, DType::Q6_K}};
    return recipes;
}

inline const QuantRecipe& quant_recipe(std::string name) {
    for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (name == "Q3_K") name = "Q3_K_M";  // as llama-quantize reads the bare names
    if (name == "Q4_K") name = "Q4_K_M";
    if (name == "Q5_K") name = "Q5_K_M";
    std::string known;
    for (const QuantRecipe& r : quant_recipes()) {
        if (name == r.name) return r;
        known += (known.empty() ? "" : ", ") + std::string(r.name);
    }
    fail("unknown quantization type \"", name, "\" (supported: ", known, ")");
}

// The type one tensor gets under a recipe. 1-D tensors (norm gains, biases) stay F32. A matrix whose rows are not
// whole blocks falls back as llama.cpp does: to a 32-weight type, then to F16.
inline DType quantized_type_for(const QuantRecipe& recipe, const std::string& name, const std::vector<int64_t>& shape,
                                int n_layers, bool has_output, bool pure) {
    if (shape.size() < 2) return DType::F32;
    DType type = recipe.base;
    const bool is_classifier = name == "output.weight" || (!has_output && name == "token_embd.weight");
    if (!pure && is_classifier) type = recipe.output;
    if (!pure && recipe.boost != QuantRecipe::Boost::None && name.rfind("blk.", 0) == 0 &&
        (name.find(".attn_v.") != std::string::npos || name.find(".ffn_down.") != std::string::npos)) {
        const int layer = std::atoi(name.c_str() + 4), eighth = n_layers / 8;
        const bool boosted = recipe.boost == QuantRecipe::Boost::Small
                                 ? layer < eighth
                                 : layer < eighth || layer >= 7 * n_layers / 8 || (layer - eighth) % 3 == 2;
        if (boosted) type = recipe.boosted;
    }
    const int64_t row = shape.back();
    if (row % dtype_block(type).elements != 0) {
        switch (type) {
            case DType::Q2_K:
            case DType::Q3_K: type = DType::Q4_0; break;
            case DType::Q4_K: type = DType::Q5_0; break;
            case DType::Q5_K: type = DType::Q5_1; break;
            case DType::Q6_K: type = DType::Q8_0; break;
            default: break;
        }
        if (row % dtype_block(type).elements != 0) type = DType::F16;
    }
    return type;
}

struct QuantizeOptions {
    std::string type = "Q8_0";  // a recipe name: Q8_0, Q4_0, Q4_K_M, …
    bool pure = false;          // every matrix in the recipe's base type, no exceptions (llama-quantize --pure)
    ThreadPool* pool = nullptr; // rows quantized in parallel when given
    // Called after each tensor: (tensors done, tensors in all, bytes written so far, the tensor's name).
    std::function<void(size_t, size_t, uint64_t, const std::string&)> progress;
};

struct QuantizeReport {
    uint64_t bytes_in = 0, bytes_out = 0;
    std::map<std::string, size_t> tensors_by_type;  // "Q4_K" → how many tensors got it
    std::vector<std::string> notes;                 // what the output could not keep (a folder's sliding window, ...)
};

// One tensor for write_gguf: name, shape (outermost first), the type it is stored in, and what fills its bytes
// (`fill(bytes)`, called once, with room for exactly its bytes).
struct GgufTensorOut {
    std::string name;
    std::vector<int64_t> shape;
    DType type = DType::F32;
    std::function<void(std::byte*)> fill;
};

// A GGUF v3 file: magic, version, counts, the metadata (each value in its own type), the tensor infos with their
// offsets, then the data, each tensor aligned. Written to `path` + ".part", renamed when complete: a failure leaves
// nothing behind. `progress(done, total, bytes written, name)` is called after each tensor.
inline void write_gguf(const std::filesystem::path& path, const std::map<std::string, detail::GgufValue>& metadata,
                       const std::vector<GgufTensorOut>& tensors, uint64_t alignment,
                       const std::function<void(size_t, size_t, uint64_t, const std::string&)>& progress = {}) {
    std::string header = "GGUF";
    auto put = [&header](auto value) { header.append(reinterpret_cast<const char*>(&value), sizeof value); };
    auto put_string = [&header](const std::string& text) { detail::gguf_append_string(header, text); };
    auto aligned = [alignment](uint64_t size) { return (size + alignment - 1) / alignment * alignment; };
    put(uint32_t{3});
    put(uint64_t{tensors.size()});
    put(uint64_t{metadata.size()});
    for (const auto& [key, value] : metadata) {
        put_string(key);
        detail::gguf_append_value(header, value);
    }
    uint64_t offset = 0;
    for (const GgufTensorOut& t : tensors) {
        put_string(t.name);
        put(static_cast<uint32_t>(t.shape.size()));
        for (auto dim = t.shape.rbegin(); dim != t.shape.rend(); ++dim) put(static_cast<uint64_t>(*dim));  // innermost first
        put(static_cast<uint32_t>(dtype_block(t.type).gguf_type));
        put(offset);
        offset += aligned(dtype_bytes(t.type, detail::checked_element_count(t.shape, t.name)));
    }
    header.resize(aligned(header.size()), '\0');

    const std::filesystem::path part = path.string() + ".part";
    std::ofstream out(part, std::ios::binary);
    if (!out) fail(part.string(), ": cannot create");
    try {
        out.write(header.data(), static_cast<std::streamsize>(header.size()));
        uint64_t written = header.size();
        std::vector<std::byte> bytes;
        for (size_t i = 0; i < tensors.size(); ++i) {
            const GgufTensorOut& t = tensors[i];
            bytes.assign(static_cast<size_t>(dtype_bytes(t.type, detail::checked_element_count(t.shape, t.name))), std::byte{0});
            t.fill(bytes.data());
            bytes.resize(static_cast<size_t>(aligned(bytes.size())), std::byte{0});
            out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
            written += bytes.size();
            if (progress) progress(i + 1, tensors.size(), written, t.name);
        }
        close_written_file(out, part.string());
    } catch (...) {
        out.close();
        std::error_code ignored;
        std::filesystem::remove(part, ignored);
        throw;
    }
    std::filesystem::rename(part, path);
}

// One tensor of a quantized file: its GGUF name, the tensor it is read from, and, where rows must be reordered (a
// Llama q/k projection from a Hugging Face folder), the source row of each output row.
struct QuantizeSource {
    std::string name;
    const Tensor* tensor = nullptr;
    std::vector<int64_t> rows;  // empty: the same order
};

namespace detail {

// Writes `sources` under `metadata`, each matrix in the type the recipe gives it, rows quantized in parallel.
inline QuantizeReport write_quantized_gguf(const std::string& source_name, const std::filesystem::path& out_path,
                                           std::map<std::string, GgufValue> metadata, const std::vector<QuantizeSource>& sources,
                                           int n_layers, uint64_t alignment, const QuantizeOptions& options) {
    const QuantRecipe& recipe = quant_recipe(options.type);
    const bool has_output = std::any_of(sources.begin(), sources.end(), [](const QuantizeSource& t) { return t.name == "output.weight"; });
    QuantizeReport report;
    std::vector<GgufTensorOut> tensors;
    for (const QuantizeSource& source : sources) {
        const Tensor& t = *source.tensor;
        if (is_quantized(t.dtype))
            fail(source_name, ": tensor ", t.name, " is already ", dtype_name(t.dtype),
                 "; quantize from a file whose weights are F32, F16 or BF16");
        const DType type = quantized_type_for(recipe, source.name, t.shape, n_layers, has_output, options.pure);
        report.bytes_in += t.bytes();
        ++report.tensors_by_type[dtype_name(type)];
        auto fill = [&t, &source, type, &source_name, pool = options.pool](std::byte* blocks) {
            const int64_t width = t.cols(), rows = t.elements() / std::max<int64_t>(width, 1);
            const uint64_t row_bytes = dtype_bytes(type, width);
            std::atomic<int64_t> bad_row{-1};  // a row holding NaN or infinity: no scale represents it
            auto quantize_rows = [&](size_t begin, size_t end, int) {
                std::vector<float> row(static_cast<size_t>(width));
                for (size_t r = begin; r < end; ++r) {
                    const int64_t from = source.rows.empty() ? static_cast<int64_t>(r) : source.rows[r];
                    t.read_row(from, row.data());
                    if (!std::all_of(row.begin(), row.end(), [](float v) { return std::isfinite(v); })) {
                        bad_row = from;
                        return;
                    }
                    quantize_row(type, row.data(), blocks + r * row_bytes, width);
                }
            };
            if (pool) pool->run_sized(static_cast<size_t>(rows), static_cast<size_t>(t.elements()) * 16, quantize_rows);
            else quantize_rows(0, static_cast<size_t>(rows), 0);
            if (bad_row >= 0) fail(source_name, ": tensor ", t.name, " row ", bad_row.load(), " holds NaN or infinity");
        };
        tensors.push_back({source.name, t.shape, type, fill});
    }
    metadata["general.file_type"] = GgufValue{int64_t{recipe.file_type}, U32, 0};
    metadata["general.quantization_version"] = GgufValue{int64_t{2}, U32, 0};
    write_gguf(out_path, metadata, tensors, alignment, [&](size_t done, size_t total, uint64_t bytes, const std::string& name) {
        report.bytes_out = bytes;
        if (options.progress) options.progress(done, total, bytes, name);
    });
    return report;
}

// The order llama.cpp's converter writes a Llama q or k projection in: within each head, the rows of the first half
// and of the second half interleaved (Hugging Face's "rotate half" pairs i with i + Dh/2; GGUF "llama" files rotate
// adjacent pairs). Output row h·Dh + 2j + s is source row h·Dh + s·Dh/2 + j.
inline std::vector<int64_t> adjacent_pair_rows(int64_t rows, int head_dim) {
    std::vector<int64_t> order(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t head = r / head_dim, within = r % head_dim;
        order[static_cast<size_t>(r)] = head * head_dim + (within % 2) * (head_dim / 2) + within / 2;
    }
    return order;
}

}  // namespace detail

// Rewrites a GGUF file (F32, F16 or BF16 weights) with its matrices quantized: the metadata is copied as it was
// (with general.file_type and general.quantization_version set), the tensors keep their order and names, the data
// section is aligned as the input says.
inline QuantizeReport quantize_gguf(const std::filesystem::path& in_path, const std::filesystem::path& out_path,
                                    const QuantizeOptions& options) {
    const GgufFile in = read_gguf(in_path);
    const std::string arch = in.string_or("general.architecture", "");
    // The tensors in the file's own order (the map holds them by name; their data pointers give the order).
    std::vector<QuantizeSource> sources;
    for (const auto& [name, tensor] : in.tensors) sources.push_back({name, &tensor, {}});
    std::sort(sources.begin(), sources.end(), [](const QuantizeSource& a, const QuantizeSource& b) { return a.tensor->data < b.tensor->data; });
    return detail::write_quantized_gguf(in_path.string(), out_path, in.metadata, sources,
                                        static_cast<int>(in.integer_or(arch + ".block_count", 0)),
                                        static_cast<uint64_t>(in.integer_or("general.alignment", 32)), options);
}

// A Hugging Face folder (config.json, safetensors, tokenizer.json) written as a quantized GGUF file, as llama.cpp's
// converter and llama-quantize would in two steps: the hyperparameters under "<architecture>.*" keys (Mistral as
// "llama", as that converter writes it), the tensors under GGUF's names, a Llama's q and k rows reordered for
// adjacent-pair RoPE, Llama 3's frequency scaling as the rope_freqs tensor, and the vocabulary from tokenizer.json
// (vocabulary_from_tokenizer_json). What the file cannot hold is said in the report's notes: a sliding window (GGUF
// "llama" files have none; llama.cpp runs them without it, and so does infer on the converted file), a missing
// tokenizer.json (the file then runs on token ids only).
inline QuantizeReport quantize_hugging_face(const std::filesystem::path& folder, const std::filesystem::path& out_path,
                                            const QuantizeOptions& options) {
    const Model model = load_model(folder);
    const ModelConfig& c = model.config;
    const Architecture* arch = find_architecture(c.architecture, false);
    const std::string name = arch && arch->in_gguf ? c.architecture : "llama";
    const Architecture* written = find_architecture(name, true);
    std::vector<std::string> notes;

    using detail::GgufValue;
    auto integer = [](int64_t value) { return GgufValue{value, detail::U32, 0}; };
    auto number = [](double value) { return GgufValue{value, detail::F32, 0}; };
    auto text = [](std::string value) { return GgufValue{std::move(value), detail::STRING, 0}; };
    const std::string a = name + ".";
    std::map<std::string, GgufValue> metadata = {
        {"general.architecture", text(name)},
        {"general.name", text(std::filesystem::absolute(folder / ".").lexically_normal().parent_path().filename().string())},
        {a + "block_count", integer(c.n_layers)},
        {a + "context_length", integer(c.context_length)},
        {a + "embedding_length", integer(c.dim)},
        {a + "feed_forward_length", integer(c.ffn_dim)},
        {a + "attention.head_count", integer(c.n_heads)},
        {a + "attention.head_count_kv", integer(c.n_kv_heads)},
        {a + "attention.layer_norm_rms_epsilon", number(c.norm_eps)},
        {a + "rope.freq_base", number(c.rope_theta)},
        {a + "rope.dimension_count", integer(c.head_dim)},
        {a + "vocab_size", integer(c.vocab_size)},
    };
    if (c.head_dim != c.dim / c.n_heads) {
        metadata[a + "attention.key_length"] = integer(c.head_dim);
        metadata[a + "attention.value_length"] = integer(c.head_dim);
    }
    if (c.rope_scaling.kind == RopeScaling::Kind::Linear) {
        metadata[a + "rope.scaling.type"] = text("linear");
        metadata[a + "rope.scaling.factor"] = number(c.rope_scaling.factor);
    }
    if (c.sliding_window > 0 && c.sliding_window < c.context_length)
        notes.push_back(concat(folder.string(), ": sliding_window ", c.sliding_window, " is not stored: GGUF \"", name,
                               "\" files have no window (llama.cpp runs them without one, and so does infer)"));

    if (std::filesystem::exists(folder / "tokenizer.json")) {
        ConvertedVocabulary vocabulary = vocabulary_from_tokenizer_json(folder);
        if (static_cast<int>(vocabulary.vocab.pieces.size()) > c.vocab_size)
            fail(folder.string(), ": tokenizer.json has ", vocabulary.vocab.pieces.size(), " tokens, more than the model's ",
                 c.vocab_size);
        // Rows of the embedding past the tokenizer's last id (vocabularies padded to a multiple of 64) get placeholder
        // tokens, as llama.cpp's converter writes them, so the file's vocabulary covers every row.
        for (int id = static_cast<int>(vocabulary.vocab.pieces.size()); id < c.vocab_size; ++id) {
            vocabulary.vocab.pieces.push_back("[PAD" + std::to_string(id) + "]");
            vocabulary.vocab.types.push_back(Vocabulary::Type::Unused);
            if (!vocabulary.vocab.scores.empty()) vocabulary.vocab.scores.push_back(0.0f);
        }
        // BOS and EOS as the tokenizer spells them (tokenizer_config.json), else config.json's; a chat model's
        // end-of-turn token among config.json's end ids becomes GGUF's eot (what the reader stops at besides EOS).
        const int bos = vocabulary.bos_id >= 0 ? vocabulary.bos_id : c.bos_id;
        std::vector<int> eos = vocabulary.eos_ids;
        if (eos.empty() && !c.eos_ids.empty()) eos.push_back(c.eos_ids.front());
        for (int id : c.eos_ids) {
            if (id < 0 || static_cast<size_t>(id) >= vocabulary.vocab.pieces.size())
                fail(folder.string(), "/config.json: eos_token_id ", id, " is outside the vocabulary (", vocabulary.vocab.pieces.size(), " tokens)");
            const std::string& piece = vocabulary.vocab.pieces[static_cast<size_t>(id)];
            if (std::find(eos.begin(), eos.end(), id) == eos.end() && (piece == "<|eot_id|>" || piece == "<|im_end|>"))
                eos.push_back(id);
        }
        metadata.merge(detail::gguf_vocabulary_metadata(vocabulary.vocab, bos, eos));
        notes.insert(notes.end(), vocabulary.notes.begin(), vocabulary.notes.end());
    } else {
        notes.push_back(folder.string() + ": no tokenizer.json: the file has no vocabulary (it runs on token ids)");
    }

    // The tensors in llama.cpp's order: embedding, each layer's, final norm, classifier.
    std::vector<QuantizeSource> sources;
    const detail::TensorNames& n = detail::gguf_names;
    std::deque<std::vector<float>> reordered_values;  // a q or k bias in adjacent-pair order (its one row reordered)
    std::deque<Tensor> reordered;
    sources.push_back({n.embedding, &model.embedding, {}});
    for (size_t l = 0; l < model.layers.size(); ++l) {
        const LayerWeights& w = model.layers[l];
        const std::string prefix = n.layer_prefix + std::to_string(l) + ".";
        auto add = [&](const char* field, const Tensor& t, bool qk_rows = false) {
            if (t.empty()) return;
            if (!qk_rows || !written->gguf_rope_pairs) {
                sources.push_back({prefix + field, &t, {}});
            } else if (t.shape.size() == 2) {
                sources.push_back({prefix + field, &t, detail::adjacent_pair_rows(t.rows(), c.head_dim)});
            } else {
                std::vector<float>& values = reordered_values.emplace_back(static_cast<size_t>(t.elements()));
                const std::vector<int64_t> order = detail::adjacent_pair_rows(t.elements(), c.head_dim);
                for (size_t i = 0; i < order.size(); ++i) values[i] = t.at(order[i]);
                Tensor& copy = reordered.emplace_back();
                copy.name = t.name;
                copy.dtype = DType::F32;
                copy.shape = t.shape;
                copy.data = reinterpret_cast<const std::byte*>(values.data());
                sources.push_back({prefix + field, &copy, {}});
            }
        };
        const std::vector<const Tensor*> tensors = w.tensors();
        const auto names = detail::layer_tensor_names(n);
        for (size_t i = 0; i < tensors.size(); ++i) {
            const Tensor* t = tensors[i];
            add(names[i], *t, t == &w.wq || t == &w.wk || t == &w.bq || t == &w.bk);  // the rows RoPE rotates
        }
    }
    sources.push_back({n.final_norm, &model.final_norm, {}});
    if (!c.tied_embeddings) sources.push_back({n.lm_head, &model.lm_head, {}});
    // Llama 3's scaling, as the per-frequency divisors llama.cpp reads from rope_freqs.weight.
    std::vector<float> divisors;
    Tensor rope_freqs;
    if (c.rope_scaling.kind == RopeScaling::Kind::Llama3) {
        for (double divisor : detail::rope_frequency_divisors(c)) divisors.push_back(static_cast<float>(divisor));
        rope_freqs.name = "rope_freqs.weight";
        rope_freqs.dtype = DType::F32;
        rope_freqs.shape = {static_cast<int64_t>(divisors.size())};
        rope_freqs.data = reinterpret_cast<const std::byte*>(divisors.data());
        sources.insert(sources.begin(), {rope_freqs.name, &rope_freqs, {}});
    }
    QuantizeReport report = detail::write_quantized_gguf(folder.string(), out_path, std::move(metadata), sources, c.n_layers, 32, options);
    report.notes = std::move(notes);
    return report;
}

// What `infer quantize -m` takes: a Hugging Face folder or a float GGUF file.
inline QuantizeReport quantize_model(const std::filesystem::path& in, const std::filesystem::path& out, const QuantizeOptions& options) {
    if (std::filesystem::is_directory(in)) return quantize_hugging_face(in, out, options);
    return quantize_gguf(in, out, options);
}

// A random-weight Llama written as GGUF (F32, F16 or BF16), with a stand-in vocabulary (the control tokens, the 256
// byte tokens, then filler pieces): a file of any shape that both infer and llama.cpp load, for benchmarks of
// `infer quantize`'s outputs. Its text is meaningless, its cost per token that of a trained model of the same shape.
inline void save_random_model_gguf(const std::filesystem::path& path, const ModelShape& shape, DType dtype, uint64_t seed) {
    const ModelConfig c = config_for_shape(shape);
    detail::validate_config(c, path.string());
    using detail::GgufValue;
    auto integer = [](int64_t value) { return GgufValue{value, detail::U32, 0}; };
    auto number = [](double value) { return GgufValue{value, detail::F32, 0}; };
    auto text = [](std::string value) { return GgufValue{std::move(value), detail::STRING, 0}; };
    std::map<std::string, GgufValue> metadata = {
        {"general.architecture", text("llama")},
        {"general.name", text("random")},
        {"general.file_type", integer(dtype == DType::F32 ? 0 : dtype == DType::F16 ? 1 : 32)},
        {"llama.block_count", integer(c.n_layers)},
        {"llama.context_length", integer(c.context_length)},
        {"llama.embedding_length", integer(c.dim)},
        {"llama.feed_forward_length", integer(c.ffn_dim)},
        {"llama.attention.head_count", integer(c.n_heads)},
        {"llama.attention.head_count_kv", integer(c.n_kv_heads)},
        {"llama.attention.layer_norm_rms_epsilon", number(1e-5)},
        {"llama.rope.freq_base", number(10000.0)},
        {"llama.rope.dimension_count", integer(c.head_dim)},
        {"llama.vocab_size", integer(c.vocab_size)},
        {"tokenizer.ggml.model", text("llama")},
        {"tokenizer.ggml.bos_token_id", integer(1)},
        {"tokenizer.ggml.eos_token_id", integer(2)},
        {"tokenizer.ggml.unknown_token_id", integer(0)},
    };
    std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
    std::vector<int64_t> types = {2, 3, 3};  // unknown, control, control
    for (int byte = 0; byte < 256 && static_cast<int>(pieces.size()) < c.vocab_size; ++byte) {
        char spelled[8];
        std::snprintf(spelled, sizeof spelled, "<0x%02X>", byte);
        pieces.push_back(spelled);
        types.push_back(6);  // byte
    }
    while (static_cast<int>(pieces.size()) < c.vocab_size) {
        pieces.push_back("\xE2\x96\x81t" + std::to_string(pieces.size()));
        types.push_back(1);  // normal
    }
    metadata["tokenizer.ggml.tokens"] = GgufValue{pieces, detail::ARRAY, detail::STRING};
    metadata["tokenizer.ggml.scores"] = GgufValue{std::vector<double>(pieces.size(), 0.0), detail::ARRAY, detail::F32};
    metadata["tokenizer.ggml.token_type"] = GgufValue{types, detail::ARRAY, detail::I32};

    // The same weights as save_random_model, under GGUF's names; the norm gains in F32, as llama.cpp's converter
    // writes every 1-D tensor (its CPU kernels multiply f32 activations by f32 gains only).
    std::vector<TensorData> weights = random_weights(shape, dtype, seed);
    for (TensorData& w : weights) {
        if (w.shape.size() != 1 || w.dtype == DType::F32) continue;
        Tensor view;  // the bytes as a tensor, to read each value back as f32
        view.dtype = w.dtype;
        view.shape = w.shape;
        view.data = w.bytes.data();
        std::vector<std::byte> widened(static_cast<size_t>(w.shape[0]) * 4);
        for (int64_t i = 0; i < w.shape[0]; ++i) {
            const float value = view.at(i);
            std::memcpy(&widened[static_cast<size_t>(i) * 4], &value, 4);
        }
        w.bytes = std::move(widened);
        w.dtype = DType::F32;
    }
    std::vector<GgufTensorOut> tensors;
    for (const TensorData& w : weights)
        tensors.push_back({detail::renamed_tensor(w.name, detail::hugging_face_names, detail::gguf_names), w.shape, w.dtype,
                           [&w](std::byte* out) { std::memcpy(out, w.bytes.data(), w.bytes.size()); }});
    write_gguf(path, metadata, tensors, 32);
}

// ==== J STRUCTURED OUTPUTS ===========================================================================================
// The grammars of section 04 start as regular expressions: this appendix parses one into an NFA over bytes, and writes
// JSON Schemas, "any JSON object" and choice lists as regular expressions. Appendix D's regex is a different tool: it
// matches the tokenizers' split patterns by backtracking over code points (lookahead, \p{L}); a token mask needs the
// set of states an automaton can be in after any byte, so this parser builds automata over bytes instead.
//
// The regex dialect is the common one: literals (UTF-8), . [...] [^...] \d \w \s and their negations, \n \t \r \f \v
// \xHH \uHHHH, groups ( ) (?: ) (?<name> ), alternation |, quantifiers * + ? {n} {n,} {n,m} (a lazy ? suffix is
// accepted: when the whole output must match, lazy and greedy match the same strings), and ^ $ at the ends, which
// change nothing for a whole-output match. [] matches nothing, as in JavaScript. Backreferences, lookaround and \b
// are refused by name: no finite automaton can decide them.

namespace detail {
// A Thompson NFA over bytes: each state consumes one byte in [lo, hi] and moves to `next`, or moves to both `next`
// and `other` without consuming anything, or accepts. The parser below builds one from a regular expression.
struct NfaState {
    enum class Kind : uint8_t { Byte, Split, Match } kind = Kind::Match;
    uint8_t lo = 0, hi = 0;
    int next = -1, other = -1;
};
struct Nfa {
    std::vector<NfaState> states;
    int start = 0;
};
}  // namespace detail

namespace detail {

// A parsed expression. A character class becomes an Alternate of UTF-8 byte sequences (each a Bytes node: one byte
// range per position), so the automaton reads bytes and still matches whole characters.
struct RegexNode {
    enum class Kind { Bytes, Concat, Alternate, Repeat } kind = Kind::Concat;  // an empty Concat matches ""
    std::vector<std::pair<uint8_t, uint8_t>> bytes;  // Bytes: one range per byte
    std::vector<RegexNode> children;
    int min = 0, max = -1;                           // Repeat: -1 is unbounded
    bool never = false;                              // matches nothing (an empty class, or simplified to it)
};

inline constexpr int regex_max_count = 1000;      // {n,m} bound: larger counts would build huge automata
inline constexpr size_t regex_max_states = 2000000;
inline constexpr int regex_max_depth = 256;             // nested groups: the parser recurses once per group
inline constexpr size_t regex_max_bytes = 1 << 20;      // an expression written from a schema: $refs and optional
                                                        // properties repeat text, and must not grow without bound

// The code points [lo, hi] (no surrogates) as UTF-8 byte-range sequences, appended as Bytes alternatives: the range
// is split until every sequence is a product of byte ranges (all its code points share a prefix structure).
inline void utf8_ranges(uint32_t lo, uint32_t hi, std::vector<RegexNode>& out) {
    if (lo > hi) return;
    static constexpr uint32_t limits[] = {0x7F, 0x7FF, 0xFFFF, 0x10FFFF};
    for (int n = 0; n < 3; ++n)  // one encoded length at a time
        if (lo <= limits[n] && hi > limits[n]) {
            utf8_ranges(lo, limits[n], out);
            utf8_ranges(limits[n] + 1, hi, out);
            return;
        }
    const int length = lo <= 0x7F ? 1 : lo <= 0x7FF ? 2 : lo <= 0xFFFF ? 3 : 4;
    for (int i = 1; i < length; ++i) {  // split where the trailing i bytes do not span 80..BF fully
        const uint32_t m = (uint32_t{1} << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_ranges(lo, lo | m, out);
                utf8_ranges((lo | m) + 1, hi, out);
                return;
            }
            if ((hi & m) != m) {
                utf8_ranges(lo, (hi & ~m) - 1, out);
                utf8_ranges(hi & ~m, hi, out);
                return;
            }
        }
    }
    std::string a, b;
    append_utf8(a, lo);
    append_utf8(b, hi);
    RegexNode node;
    node.kind = RegexNode::Kind::Bytes;
    for (size_t i = 0; i < a.size(); ++i) node.bytes.emplace_back(static_cast<uint8_t>(a[i]), static_cast<uint8_t>(b[i]));
    out.push_back(std::move(node));
}

class RegexParser {
public:
    explicit RegexParser(std::string_view pattern) : text_(pattern) {}

    RegexNode parse() {
        if (find_invalid_utf8(text_) != std::string_view::npos) error("is not valid UTF-8");
        RegexNode node = alternation();
        if (at_ < text_.size()) error(text_[at_] == ')' ? "has an unmatched ')'" : "has an unexpected character");
        return node;
    }

private:
    using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;  // code points

    [[noreturn]] void error(std::string_view what) const {
        fail("regular expression \"", text_, "\" ", what, " (at byte ", at_, ")");
    }
    bool more() const { return at_ < text_.size(); }
    char peek() const { return text_[at_]; }
    bool take(char c) {
        if (more() && peek() == c) {
            ++at_;
            return true;
        }
        return false;
    }

    RegexNode alternation() {
        RegexNode first = concatenation();
        if (!more() || peek() != '|') return first;
        RegexNode any;
        any.kind = RegexNode::Kind::Alternate;
        any.children.push_back(std::move(first));
        while (take('|')) any.children.push_back(concatenation());
        return any;
    }

    RegexNode concatenation() {
        RegexNode all;  // Concat
        while (more() && peek() != '|' && peek() != ')') {
            if (take('^') || take('$')) continue;  // anchors: the whole output matches anyway
            all.children.push_back(repetition(atom()));
        }
        return all;
    }

    RegexNode repetition(RegexNode node) {
        while (more()) {
            int min = 0, max = -1;
            const size_t quantifier = at_;
            if (take('*')) {
            } else if (take('+')) {
                min = 1;
            } else if (take('?')) {
                max = 1;
            } else if (peek() == '{' && at_ + 1 < text_.size() && std::isdigit(static_cast<unsigned char>(text_[at_ + 1]))) {
                ++at_;
                min = max = number();
                if (take(',')) max = more() && peek() == '}' ? -1 : number();
                if (!take('}')) error("has an unterminated {n,m}");
                if (max >= 0 && max < min) error("has a count {n,m} with m < n");
            } else {
                break;
            }
            if (take('+')) { at_ = quantifier; error("uses a possessive quantifier, which is not supported"); }
            take('?');  // lazy: the same language
            RegexNode repeat;
            repeat.kind = RegexNode::Kind::Repeat;
            repeat.min = min;
            repeat.max = max;
            repeat.children.push_back(std::move(node));
            node = std::move(repeat);
        }
        return node;
    }

    int number() {
        int value = 0;
        const size_t begin = at_;
        while (more() && std::isdigit(static_cast<unsigned char>(peek()))) {
            value = value * 10 + (text_[at_++] - '0');
            if (value > regex_max_count) error(concat("has a count above ", regex_max_count));
        }
        if (at_ == begin) error("has a count that is not a number");
        return value;
    }

    RegexNode atom() {
        if (take('(')) {
            if (++depth_ > regex_max_depth) error(concat("nests groups more than ", regex_max_depth, " deep"));
            if (take('?')) {
                if (take(':')) {
                } else if ((take('<') || (take('P') && take('<'))) && more() && peek() != '=' && peek() != '!') {
                    while (more() && peek() != '>') ++at_;  // a named group: the name changes nothing here
                    if (!take('>')) error("has an unterminated group name");
                } else {
                    error("uses lookaround or a group flag, which is not supported");
                }
            }
            RegexNode inside = alternation();
            if (!take(')')) error("has an unmatched '('");
            --depth_;
            return inside;
        }
        if (take('[')) return from_ranges(char_class());
        if (take('.')) return from_ranges({{0, '\n' - 1}, {'\n' + 1, 0x10FFFF}});
        if (more() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{' || peek() == ')'))
            error("has a quantifier with nothing to repeat");
        if (take('\\')) return from_ranges(escape(false));
        return literal(code_point());
    }

    uint32_t code_point() {
        int length = 0;
        const uint32_t cp = static_cast<uint32_t>(code_point_at(text_, at_, &length));
        at_ += static_cast<size_t>(length);
        return cp;
    }

    static RegexNode literal(uint32_t cp) {
        std::string bytes;
        append_utf8(bytes, cp);
        RegexNode node;
        node.kind = RegexNode::Kind::Bytes;
        for (char c : bytes) node.bytes.emplace_back(static_cast<uint8_t>(c), static_cast<uint8_t>(c));
        return node;
    }

    uint32_t hex(int digits) {
        uint32_t value = 0;
        for (int i = 0; i < digits; ++i) {
            if (!more() || !std::isxdigit(static_cast<unsigned char>(peek()))) error("has a malformed \\x or \\u escape");
            const char c = text_[at_++];
            value = value * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(c)) ? c - '0' : (c | 0x20) - 'a' + 10);
        }
        return value;
    }

    // After a backslash: the code points it stands for.
    Ranges escape(bool in_class) {
        if (!more()) error("ends with a lone backslash");
        const char c = text_[at_++];
        static const Ranges digits = {{'0', '9'}}, word = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}},
                            space = {{'\t', '\r'}, {' ', ' '}};
        switch (c) {
        case 'd': return digits;
        case 'w': return word;
        case 's': return space;
        case 'D': return complement(digits);
        case 'W': return complement(word);
        case 'S': return complement(space);
        case 'n': return {{'\n', '\n'}};
        case 't': return {{'\t', '\t'}};
        case 'r': return {{'\r', '\r'}};
        case 'f': return {{'\f', '\f'}};
        case 'v': return {{'\v', '\v'}};
        case '0': return {{0, 0}};
        case 'x': { const uint32_t v = hex(2); return {{v, v}}; }
        case 'u': { const uint32_t v = hex(4); return {{v, v}}; }
        case 'b': if (in_class) return {{'\b', '\b'}}; [[fallthrough]];
        default:
            if (std::isalnum(static_cast<unsigned char>(c))) {
                --at_;
                error(concat("uses \\", c, ", which is not supported (backreferences, \\b, \\p and the like need more than an automaton)"));
            }
            --at_;
            const uint32_t cp = code_point();  // an escaped punctuation character stands for itself
            return {{cp, cp}};
        }
    }

    Ranges char_class() {
        const bool negated = take('^');
        Ranges ranges;
        auto member = [&] {
            if (take('\\')) return escape(true);
            const uint32_t cp = code_point();
            return Ranges{{cp, cp}};
        };
        while (more() && peek() != ']') {
            Ranges item = member();
            const bool single = item.size() == 1 && item[0].first == item[0].second;
            if (single && more() && peek() == '-' && at_ + 1 < text_.size() && text_[at_ + 1] != ']') {
                ++at_;
                const Ranges upper = member();
                if (upper.size() != 1 || upper[0].first != upper[0].second) error("has a range whose end is a class");
                if (upper[0].first < item[0].first) error("has a range whose end comes before its start");
                item[0].second = upper[0].first;
            }
            ranges.insert(ranges.end(), item.begin(), item.end());
        }
        if (!take(']')) error("has an unterminated [ class");
        return negated ? complement(ranges) : ranges;
    }

    // Sorted, merged ranges of code points.
    static Ranges normalized(Ranges ranges) {
        std::sort(ranges.begin(), ranges.end());
        Ranges out;
        for (const auto& r : ranges) {
            if (!out.empty() && r.first <= out.back().second + 1) out.back().second = std::max(out.back().second, r.second);
            else out.push_back(r);
        }
        return out;
    }

    static Ranges complement(const Ranges& ranges) {
        Ranges out;
        uint32_t next = 0;
        for (const auto& r : normalized(ranges)) {
            if (r.first > next) out.emplace_back(next, r.first - 1);
            next = r.second + 1;
        }
        if (next <= 0x10FFFF) out.emplace_back(next, 0x10FFFF);
        return out;
    }

    // Code points to UTF-8 alternatives; surrogates (D800–DFFF) are no characters and are left out.
    static RegexNode from_ranges(const Ranges& ranges) {
        RegexNode any;
        any.kind = RegexNode::Kind::Alternate;
        for (auto [lo, hi] : normalized(ranges)) {
            if (lo <= 0xD7FF) utf8_ranges(lo, std::min<uint32_t>(hi, 0xD7FF), any.children);
            if (hi >= 0xE000) utf8_ranges(std::max<uint32_t>(lo, 0xE000), hi, any.children);
        }
        if (any.children.empty()) any.never = true;
        return any;
    }

    std::string_view text_;
    size_t at_ = 0;
    int depth_ = 0;  // groups open at at_
};

// Propagates "matches nothing" upwards, so that every node left can match something: the automaton then needs no
// test for dead ends beyond an empty set of states.
inline void simplify(RegexNode& node) {
    using Kind = RegexNode::Kind;
    for (RegexNode& child : node.children) simplify(child);
    if (node.kind == Kind::Concat)
        node.never = std::any_of(node.children.begin(), node.children.end(), [](const RegexNode& c) { return c.never; });
    if (node.kind == Kind::Alternate) {
        std::erase_if(node.children, [](const RegexNode& c) { return c.never; });
        node.never = node.children.empty();
    }
    if (node.kind == Kind::Repeat && node.children[0].never) {
        node.never = node.min > 0;
        if (!node.never) node = RegexNode{};  // x{0,m} of nothing: the empty string
    }
}

// Thompson's construction, built back to front: each node is compiled knowing the state that follows it.
class NfaBuilder {
public:
    explicit NfaBuilder(Nfa& nfa, std::string_view pattern) : nfa_(nfa), pattern_(pattern) {}

    int compile(const RegexNode& node, int next) {
        using Kind = RegexNode::Kind;
        switch (node.kind) {
        case Kind::Bytes:
            for (size_t i = node.bytes.size(); i-- > 0;) next = add({NfaState::Kind::Byte, node.bytes[i].first, node.bytes[i].second, next, -1});
            return next;
        case Kind::Concat:
            for (size_t i = node.children.size(); i-- > 0;) next = compile(node.children[i], next);
            return next;
        case Kind::Alternate: {
            int start = compile(node.children.back(), next);
            for (size_t i = node.children.size() - 1; i-- > 0;) start = add({NfaState::Kind::Split, 0, 0, compile(node.children[i], next), start});
            return start;
        }
        case Kind::Repeat: {
            const RegexNode& body = node.children[0];
            int current = next;
            if (node.max < 0) {  // a loop: split into one more body (which comes back here) or out
                const int loop = add({NfaState::Kind::Split, 0, 0, -1, next});
                nfa_.states[static_cast<size_t>(loop)].next = compile(body, loop);
                current = loop;
            } else {
                for (int i = node.min; i < node.max; ++i) current = add({NfaState::Kind::Split, 0, 0, compile(body, current), next});
            }
            for (int i = 0; i < node.min; ++i) current = compile(body, current);
            return current;
        }
        }
        return next;
    }

private:
    int add(NfaState state) {
        if (nfa_.states.size() >= regex_max_states)
            fail("regular expression \"", pattern_.substr(0, 200), pattern_.size() > 200 ? "…" : "", "\" needs more than ",
                 regex_max_states, " automaton states; reduce its counts {n,m}");
        nfa_.states.push_back(state);
        return static_cast<int>(nfa_.states.size()) - 1;
    }
    Nfa& nfa_;
    std::string_view pattern_;
};

inline Nfa compile_regex(std::string_view pattern) {
    RegexNode root = RegexParser(pattern).parse();
    simplify(root);
    if (root.never) fail("regular expression \"", pattern, "\" matches nothing");
    Nfa nfa;
    nfa.states.push_back({NfaState::Kind::Match, 0, 0, -1, -1});
    nfa.start = NfaBuilder(nfa, pattern).compile(root, 0);
    return nfa;
}

}  // namespace detail

// ---- Languages as regular expressions: literals, choices, JSON ------------------------------------------------------

// `text` matched literally.
inline std::string regex_escape(std::string_view text) {
    std::string out;
    for (char c : text) {
        if (std::strchr("\\.^$|?*+()[]{}/-", c) && c != '\0') out += '\\';
        out += c;
    }
    return out;
}

// Exactly one of `choices` (vLLM's guided_choice).
inline std::string regex_for_choices(const std::vector<std::string>& choices) {
    if (choices.empty()) fail("a choice list must hold at least one string");
    std::string out = "(";
    for (size_t i = 0; i < choices.size(); ++i) out += (i ? "|" : "") + regex_escape(choices[i]);
    return out + ")";
}

namespace json_regex {
// JSON's pieces. Whitespace: an optional single space after ':' and ',', none elsewhere: models often write
// {"a": 1, "b": 2}, and unbounded whitespace would let a model pad forever.
inline const std::string space = "[ ]?";
inline const std::string string_char = R"(([^"\\\x00-\x1F]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4})))";
inline const std::string string = "\"" + string_char + "*\"";
inline const std::string integer = "-?(0|[1-9][0-9]*)";
inline const std::string number = integer + R"((\.[0-9]+)?([eE][+-]?[0-9]+)?)";
inline const std::string scalar = "(" + string + "|" + number + "|true|false|null)";

// Any JSON value nested at most `depth` objects/arrays deep (0: scalars only).
inline std::string any_value(int depth) {
    if (depth <= 0) return scalar;
    const std::string inner = any_value(depth - 1);
    const std::string object = "\\{(" + string + ":" + space + inner + "(," + space + string + ":" + space + inner + ")*)?\\}";
    const std::string array = "\\[(" + inner + "(," + space + inner + ")*)?\\]";
    return "(" + scalar.substr(1, scalar.size() - 2) + "|" + object + "|" + array + ")";
}
}  // namespace json_regex

// OpenAI's response_format {"type": "json_object"}: one JSON object, nested at most `depth` levels (objects and arrays).
inline std::string regex_for_json_object(int depth = 4) {
    const std::string inner = json_regex::any_value(depth - 1);
    const std::string& s = json_regex::string;
    return "\\{(" + s + ":" + json_regex::space + inner + "(," + json_regex::space + s + ":" + json_regex::space + inner + ")*)?\\}";
}

namespace detail {

// The integers in [lo, hi] (both >= 0) as decimal text without leading zeros: split into ranges of equal length whose
// digits vary independently, the classic construction.
inline std::string natural_range(uint64_t lo, uint64_t hi) {
    if (lo > hi) return "[]";
    std::vector<std::string> parts;
    std::function<void(uint64_t, uint64_t)> split = [&](uint64_t a, uint64_t b) {
        const std::string sa = std::to_string(a), sb = std::to_string(b);
        if (sa.size() < sb.size()) {  // different lengths: up to 99…9 of a's length, then the rest
            uint64_t nines = 9;
            for (size_t i = 1; i < sa.size(); ++i) nines = nines * 10 + 9;
            split(a, nines);
            split(nines + 1, b);
            return;
        }
        // Same length: the shared prefix, then one digit range, then free digits — when a and b allow it.
        size_t common = 0;
        while (common < sa.size() && sa[common] == sb[common]) ++common;
        if (common == sa.size()) {
            parts.push_back(sa);
            return;
        }
        const bool a_low = sa.find_first_not_of('0', common + 1) == std::string::npos;
        const bool b_high = sb.find_first_not_of('9', common + 1) == std::string::npos;
        if (a_low && b_high) {
            std::string part = sa.substr(0, common) + "[" + sa[common] + "-" + sb[common] + "]";
            for (size_t i = common + 1; i < sa.size(); ++i) part += "[0-9]";
            parts.push_back(part);
            return;
        }
        uint64_t unit = 1;
        for (size_t i = common + 1; i < sa.size(); ++i) unit *= 10;
        if (!a_low) {  // a up to the end of its block
            const uint64_t end = (a / unit) * unit + unit - 1;
            split(a, end);
            if (end < b) split(end + 1, b);
            return;
        }
        const uint64_t start = (b / unit) * unit;  // b from the start of its block
        split(a, start - 1);
        split(start, b);
    };
    split(lo, hi);
    std::string out = "(";
    for (size_t i = 0; i < parts.size(); ++i) out += (i ? "|" : "") + parts[i];
    return out + ")";
}

// Integers in [lo, hi], either bound optional.
inline std::string integer_range(std::optional<int64_t> lo, std::optional<int64_t> hi) {
    if (!lo && !hi) return json_regex::integer;
    if (lo && hi && *lo > *hi) return "[]";
    const std::string unbounded_natural = "(0|[1-9][0-9]*)";
    std::vector<std::string> parts;
    // Naturals in [max(lo, 0), hi]: hi absent means every natural from lo on (lo's range up to its length's 9…9,
    // then any longer number).
    if (!hi || *hi >= 0) {
        const uint64_t a = lo && *lo > 0 ? static_cast<uint64_t>(*lo) : 0;
        if (hi) {
            parts.push_back(natural_range(a, static_cast<uint64_t>(*hi)));
        } else if (a == 0) {
            parts.push_back(unbounded_natural);
        } else {
            const size_t digits = std::to_string(a).size();
            uint64_t nines = 0;
            for (size_t i = 0; i < digits; ++i) nines = nines * 10 + 9;
            parts.push_back(natural_range(a, nines));
            parts.push_back("[1-9][0-9]{" + std::to_string(digits) + ",}");
        }
    }
    // Negatives in [lo, min(hi, -1)]: "-" and the magnitudes.
    if (!lo || *lo < 0) {
        const uint64_t smallest = hi && *hi < 0 ? static_cast<uint64_t>(-*hi) : 1;
        if (lo) {
            parts.push_back("-" + natural_range(smallest, static_cast<uint64_t>(-*lo)));
        } else {
            const size_t digits = std::to_string(smallest).size();
            uint64_t nines = 0;
            for (size_t i = 0; i < digits; ++i) nines = nines * 10 + 9;
            parts.push_back("-" + natural_range(smallest, nines));
            parts.push_back("-[1-9][0-9]{" + std::to_string(digits) + ",}");
        }
    }
    std::string out = "(";
    for (size_t i = 0; i < parts.size(); ++i) out += (i ? "|" : "") + parts[i];
    return out + ")";
}

// A JSON Schema (the subset structured outputs use) as a regular expression over its JSON text. Every keyword is
// either honoured, an annotation (title, description…) or refused by name with its place in the schema.
class JsonSchemaWriter {
public:
    JsonSchemaWriter(const Json& root, std::string origin) : root_(root), origin_(std::move(origin)) {}

    // Every subschema's expression is checked as it is written: an array repeats its item, anyOf its options, so a
    // chain of $refs can grow the text fourfold per level, and only a check at each level bounds the memory.
    std::string value(const Json& schema, const std::string& path) {
        std::string regex = value_unchecked(schema, path);
        if (regex.size() > regex_max_bytes)
            refuse(path, concat("the schema's expression grows past ", regex_max_bytes, " bytes here; simplify it"));
        return regex;
    }

    static constexpr int any_depth = 3;  // nesting allowed where a schema says "any value"

private:
    std::string value_unchecked(const Json& schema, const std::string& path) {
        if (schema.is_bool()) return schema.as_bool() ? json_regex::any_value(any_depth) : "[]";
        if (!schema.is_object()) refuse(path, "a schema must be an object or a boolean");
        for (const auto& [key, _] : schema.as_object()) {
            static const std::set<std::string, std::less<>> unsupported = {
                "pattern", "patternProperties", "multipleOf", "uniqueItems", "contains", "minContains", "maxContains",
                "prefixItems", "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
                "if", "then", "else", "not", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "additionalItems"};
            if (unsupported.count(key)) refuse(path, concat("keyword \"", key, "\" is not supported by structured outputs"));
        }
        if (++calls_ > max_calls) refuse(path, concat("the schema expands to more than ", max_calls, " subschemas; simplify it"));
        if (const Json* ref = schema.find("$ref")) return reference(*ref, path);
        if (const Json* c = schema.find("const")) return regex_escape(c->dump());
        if (const Json* e = schema.find("enum")) {
            if (!e->is_array() || e->as_array().empty()) refuse(path + "/enum", "\"enum\" must be a non-empty array");
            std::vector<std::string> literals;
            for (const Json& item : e->as_array()) literals.push_back(item.dump());
            return regex_for_choices(literals);
        }
        for (const char* key : {"anyOf", "oneOf"})
            if (const Json* options = schema.find(key)) {
                if (!options->is_array() || options->as_array().empty()) refuse(path + "/" + key, "must be a non-empty array");
                std::string out = "(";
                for (size_t i = 0; i < options->as_array().size(); ++i)
                    out += (i ? "|" : "") + value(options->as_array()[i], concat(path, "/", key, "/", i));
                return out + ")";
            }
        if (const Json* all = schema.find("allOf")) {
            if (!all->is_array() || all->as_array().size() != 1) refuse(path + "/allOf", "\"allOf\" is supported with one schema only");
            return value(all->as_array()[0], path + "/allOf/0");
        }
        const Json* type = schema.find("type");
        if (!type) {  // no type: what the other keywords say, else anything
            if (schema.find("properties")) return object(schema, path);
            if (schema.find("items")) return array(schema, path);
            return json_regex::any_value(any_depth);
        }
        if (type->is_array()) {
            std::string out = "(";
            for (size_t i = 0; i < type->as_array().size(); ++i) {
                if (!type->as_array()[i].is_string()) refuse(path + "/type", "\"type\" must name types");
                out += (i ? "|" : "") + typed(schema, type->as_array()[i].as_string(), path);
            }
            return out + ")";
        }
        if (!type->is_string()) refuse(path + "/type", "\"type\" must be a string or an array of strings");
        return typed(schema, type->as_string(), path);
    }

    [[noreturn]] void refuse(const std::string& path, const std::string& what) const {
        fail(origin_, " at ", path.empty() ? "/" : path, ": ", what);
    }

    std::string typed(const Json& schema, const std::string& type, const std::string& path) {
        if (type == "object") return object(schema, path);
        if (type == "array") return array(schema, path);
        if (type == "string") return string(schema, path);
        if (type == "integer") return integer(schema, path);
        if (type == "number") {
            for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
                if (schema.find(key)) refuse(path, concat("keyword \"", key, "\" is supported for integers only"));
            return json_regex::number;
        }
        if (type == "boolean") return "(true|false)";
        if (type == "null") return "null";
        refuse(path + "/type", concat("unknown type \"", type, "\""));
    }

    std::optional<int64_t> whole(const Json& schema, const char* key, const std::string& path) const {
        const Json* v = schema.find(key);
        if (!v) return std::nullopt;
        if (!v->is_number() || v->as_number() != std::floor(v->as_number()) || std::abs(v->as_number()) > 1e15)
            refuse(path + "/" + key, concat("\"", key, "\" must be a whole number"));
        return static_cast<int64_t>(v->as_number());
    }

    std::string integer(const Json& schema, const std::string& path) {
        std::optional<int64_t> lo = whole(schema, "minimum", path), hi = whole(schema, "maximum", path);
        if (auto e = whole(schema, "exclusiveMinimum", path)) lo = lo ? std::max(*lo, *e + 1) : *e + 1;
        if (auto e = whole(schema, "exclusiveMaximum", path)) hi = hi ? std::min(*hi, *e - 1) : *e - 1;
        return integer_range(lo, hi);
    }

    std::string string(const Json& schema, const std::string& path) {
        if (const Json* format = schema.find("format")) {
            static const std::map<std::string, std::string, std::less<>> formats = {
                {"date", R"re("[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")re"},
                {"time", R"re("([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?")re"},
                {"date-time", R"re("[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")re"},
                {"uuid", R"re("[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")re"},
            };
            if (!format->is_string() || !formats.count(format->as_string()))
                refuse(path + "/format", concat("format ", format->dump(), " is not supported (supported: date, time, date-time, uuid)"));
            return formats.find(format->as_string())->second;
        }
        const int64_t min = whole(schema, "minLength", path).value_or(0);
        const std::optional<int64_t> max = whole(schema, "maxLength", path);
        if (min < 0 || (max && *max < min) || min > regex_max_count || (max && *max > regex_max_count))
            refuse(path, concat("minLength/maxLength must satisfy 0 <= minLength <= maxLength <= ", regex_max_count));
        if (min == 0 && !max) return json_regex::string;
        return "\"" + json_regex::string_char + "{" + std::to_string(min) + "," + (max ? std::to_string(*max) : "") + "}\"";
    }

    std::string array(const Json& schema, const std::string& path) {
        const Json* items = schema.find("items");
        const std::string item = items ? value(*items, path + "/items") : json_regex::any_value(any_depth - 1);
        const int64_t min = whole(schema, "minItems", path).value_or(0);
        const std::optional<int64_t> max = whole(schema, "maxItems", path);
        if (min < 0 || (max && *max < min) || min > regex_max_count || (max && *max > regex_max_count))
            refuse(path, concat("minItems/maxItems must satisfy 0 <= minItems <= maxItems <= ", regex_max_count));
        if (max && *max == 0) return "\\[\\]";
        const std::string more = "(," + json_regex::space + item + "){" + std::to_string(std::max<int64_t>(min - 1, 0)) + "," +
                                 (max ? std::to_string(*max - 1) : "") + "}";
        const std::string some = item + more;
        return "\\[" + (min == 0 ? "(" + some + ")?" : some) + "\\]";
    }

    // Properties in the schema's order; the required ones always, the others optional. A comma goes before every
    // property but the first one written, so the expression tracks whether one has been written yet.
    std::string object(const Json& schema, const std::string& path) {
        const Json* properties = schema.find("properties");
        if (const Json* extra = schema.find("additionalProperties"); extra && !(extra->is_bool() && !extra->as_bool()) && properties)
            refuse(path + "/additionalProperties", "only false is supported beside \"properties\" (the output has exactly the properties listed)");
        if (!properties) {
            if (const Json* extra = schema.find("additionalProperties"); extra && extra->is_bool() && !extra->as_bool()) return "\\{\\}";
            return regex_for_json_object(any_depth);
        }
        if (!properties->is_object()) refuse(path + "/properties", "\"properties\" must be an object");
        std::set<std::string, std::less<>> required;
        if (const Json* r = schema.find("required")) {
            if (!r->is_array()) refuse(path + "/required", "\"required\" must be an array of names");
            for (const Json& name : r->as_array()) {
                if (!name.is_string() || !properties->find(name.as_string()))
                    refuse(path + "/required", concat("names ", name.dump(), ", which is not in \"properties\""));
                required.insert(name.as_string());
            }
        }
        std::vector<std::pair<std::string, bool>> members;  // "key": value, required
        for (const auto& [key, sub] : properties->as_object())
            members.emplace_back(regex_escape(Json(key).dump()) + ":" + json_regex::space + value(sub, path + "/properties/" + key),
                                 required.count(key) > 0);
        // after[i]: the members from i on, once one has been written (each with its comma).
        std::vector<std::string> after(members.size() + 1);
        for (size_t i = members.size(); i-- > 0;) {
            const std::string one = "," + json_regex::space + members[i].first;
            after[i] = (members[i].second ? one : "(" + one + ")?") + after[i + 1];
        }
        // first(i): the members from i on, none written yet.
        std::string none_yet;  // first(members.size()): nothing left, nothing written
        for (size_t i = members.size(); i-- > 0;) {
            const std::string with = members[i].first + after[i + 1];
            none_yet = members[i].second ? with : "(" + with + (none_yet.empty() ? ")?" : "|" + none_yet + ")");
        }
        return "\\{" + none_yet + "\\}";
    }

    std::string reference(const Json& ref, const std::string& path) {
        if (!ref.is_string()) refuse(path + "/$ref", "\"$ref\" must be a string");
        const std::string& target = ref.as_string();
        const Json* found = nullptr;
        for (const char* prefix : {"#/$defs/", "#/definitions/"})
            if (target.starts_with(prefix)) {
                const Json* defs = root_.find(std::string_view(prefix + 2, std::strlen(prefix) - 3));
                if (defs) found = defs->find(target.substr(std::strlen(prefix)));
            }
        if (target == "#") found = &root_;
        if (!found) refuse(path + "/$ref", concat("\"", target, "\" is not a definition of this schema (#/$defs/NAME)"));
        // A recursive schema (a tree) unrolls to a bounded depth; past it the reference matches nothing, so only its
        // non-recursive alternatives remain.
        int& depth = expanding_[target];
        if (depth >= max_ref_depth) return "[]";
        ++depth;
        std::string out = value(*found, target.substr(1));
        --depth;
        return out;
    }

    static constexpr int max_ref_depth = 3;
    static constexpr int max_calls = 100000;  // $refs to $refs can multiply: a bound on the work, whatever the schema
    int calls_ = 0;
    const Json& root_;
    std::string origin_;
    std::map<std::string, int> expanding_;
};

}  // namespace detail

// A JSON Schema as a regular expression over the JSON text it allows. `origin` names it in messages.
inline std::string regex_for_json_schema(const Json& schema, const std::string& origin = "JSON schema") {
    std::string regex = detail::JsonSchemaWriter(schema, origin).value(schema, "");
    if (regex.size() > detail::regex_max_bytes)
        fail(origin, ": the schema's expression is ", regex.size(), " bytes, more than ", detail::regex_max_bytes, "; simplify it");
    return regex;
}

// ---- Structured outputs: the grammar --------------------------------------------------------------------------------
// Section 04's token mask: a grammar is a regular expression over bytes compiled (above) into an NFA, whose states
// this lazy DFA builds as outputs reach them; each state's mask is a walk of the vocabulary's trie.


// Every token's bytes in a trie, shared by the grammars of one tokenizer. Special tokens (BOS, <|im_start|>) spell no
// text and are left out; the end ids are allowed exactly where the output may end.
class TokenTrie {
public:
    explicit TokenTrie(const Tokenizer& tokenizer) : vocab_size_(tokenizer.vocab_size()), end_ids_(tokenizer.eos_ids()) {
        std::vector<std::pair<std::string, int>> spelled;
        std::vector<std::optional<std::string>> bytes = tokenizer.all_token_bytes();
        for (int id = 0; id < vocab_size_; ++id)
            if (bytes[static_cast<size_t>(id)] && !bytes[static_cast<size_t>(id)]->empty() &&
                std::find(end_ids_.begin(), end_ids_.end(), id) == end_ids_.end())
                spelled.emplace_back(std::move(*bytes[static_cast<size_t>(id)]), id);
        std::sort(spelled.begin(), spelled.end());
        // Sorted byte strings share their prefixes with their predecessor: `path` holds the nodes of the previous one.
        nodes_.push_back({});  // the root: the empty prefix
        std::vector<int> path = {0};
        std::string previous;
        for (const auto& [text, id] : spelled) {
            size_t common = 0;
            while (common < text.size() && common < previous.size() && text[common] == previous[common]) ++common;
            path.resize(common + 1);
            for (size_t i = common; i < text.size(); ++i) {
                const int parent = path.back(), node = static_cast<int>(nodes_.size());
                nodes_.push_back({.byte = static_cast<uint8_t>(text[i])});
                if (nodes_[static_cast<size_t>(parent)].last_child >= 0)
                    nodes_[static_cast<size_t>(nodes_[static_cast<size_t>(parent)].last_child)].next_sibling = node;
                else nodes_[static_cast<size_t>(parent)].first_child = node;
                nodes_[static_cast<size_t>(parent)].last_child = node;
                path.push_back(node);
            }
            Node& end = nodes_[static_cast<size_t>(path.back())];
            if (end.ids_begin < 0) end.ids_begin = static_cast<int>(ids_.size());
            ids_.push_back(id);
            end.ids_end = static_cast<int>(ids_.size());
            bytes_of_[id] = text;
            previous = text;
        }
    }

    int vocab_size() const { return vocab_size_; }
    const std::vector<int>& end_ids() const { return end_ids_; }
    // The token's bytes, or nullptr for one that spells no text (a special token, an end id).
    const std::string* bytes(int id) const {
        auto found = bytes_of_.find(id);
        return found == bytes_of_.end() ? nullptr : &found->second;
    }
    size_t node_count() const { return nodes_.size(); }

private:
    friend class Grammar;
    struct Node {
        int first_child = -1, last_child = -1, next_sibling = -1;
        uint8_t byte = 0;
        int ids_begin = -1, ids_end = -1;  // ids_[begin, end): the tokens whose bytes end here
    };
    int vocab_size_ = 0;
    std::vector<int> end_ids_;
    std::vector<Node> nodes_;
    std::vector<int> ids_;
    std::unordered_map<int, std::string> bytes_of_;
};

// One compiled language over one vocabulary, shared (read-only from outside, thread-safe) by every request that asks
// for it. States are numbered as they are built; 0 is the start.
class Grammar {
public:
    // `regex` must match the whole output. `description` names the grammar in messages ("response_format json_schema").
    Grammar(std::string_view regex, std::shared_ptr<const TokenTrie> trie, std::string description);
    ~Grammar();

    static constexpr int max_states = 20000;  // each holds 256 transitions and its mask: bounds memory per grammar
    static constexpr uint64_t max_work = 200'000'000;  // NFA states visited in all: about a second, bounds the time
    static constexpr int start = 0;
    const std::string& description() const { return description_; }
    const TokenTrie& trie() const { return *trie_; }
    const std::vector<int>& end_ids() const;  // the tokens that end an output where it may end
    int state_count() const;

    bool accepts(int state) const;       // the output so far is a whole sentence of the language
    bool can_continue(int state) const;  // some byte may still follow

    // The tokens allowed after `state`, one bit per id ([V / 64] words), the end ids included where the output may end.
    // Computed on first use, then kept: the reference stays valid for the grammar's life.
    const std::vector<uint64_t>& mask(int state) const;

    // The state after `token`'s bytes, or -1 if the token leaves the language.
    int advance(int state, int token) const;

private:
    struct State;
    std::vector<int> closure(std::vector<int>& from) const;
    int state_for(std::vector<int> nfa) const;
    int step(int state, uint8_t byte) const;
    const std::vector<uint64_t>& mask_locked(int state) const;

    detail::Nfa nfa_;
    std::shared_ptr<const TokenTrie> trie_;
    std::string description_;
    mutable std::mutex mutex_;
    mutable std::vector<std::unique_ptr<State>> states_;
    mutable std::map<std::vector<int>, int> index_;
    mutable uint64_t work_ = 0;
    mutable std::vector<uint32_t> seen_;  // [NFA states] closure's marks: == stamp_ when visited in the current call
    mutable uint32_t stamp_ = 0;
};


namespace detail {
inline void mask_logits(const Grammar& grammar, int state, bool ignore_eos, std::span<float> logits) {
    const std::vector<uint64_t>& allowed = grammar.mask(state);
    const float none = -std::numeric_limits<float>::infinity();
    for (size_t id = 0; id < logits.size(); ++id)
        if (!(id / 64 < allowed.size() && (allowed[id / 64] >> (id % 64) & 1))) logits[id] = none;
    if (ignore_eos)  // the output may end, but the request asked not to: only the grammar's own end stops it
        for (int id : grammar.end_ids())
            if (id >= 0 && static_cast<size_t>(id) < logits.size()) logits[static_cast<size_t>(id)] = none;
    if (std::none_of(logits.begin(), logits.end(), [&](float l) { return l != none; }))
        fail(grammar.description(), ": no token can continue the output from here");
}

inline int advance_grammar(const Grammar& grammar, int state, int token) {
    const int next = grammar.advance(state, token);
    if (next < 0) fail(grammar.description(), ": token ", token, " leaves the language the output must stay in");
    return next;
}

inline bool grammar_finished(const Grammar& grammar, int state) {
    return grammar.accepts(state) && !grammar.can_continue(state);
}
}  // namespace detail

// ---- The grammar's automaton ----------------------------------------------------------------------------------------
// Section 04's Grammar: a lazy DFA over the NFA, each state's token mask found by walking the vocabulary's trie.


inline Grammar::Grammar(std::string_view regex, std::shared_ptr<const TokenTrie> trie, std::string description)
    : nfa_(detail::compile_regex(regex)), trie_(std::move(trie)), description_(std::move(description)) {
        std::vector<int> start = {nfa_.start};
        state_for(closure(start));
        std::lock_guard lock(mutex_);
        if (mask_locked(0).empty()) fail(description_, ": no token of the vocabulary can start an output it allows");
    }

struct Grammar::State {
    std::vector<int> nfa;  // the Byte and Match states the automaton can be in, sorted
    bool accepting = false, consumes = false;
    std::array<int, 256> next;  // -2: not built yet; -1: dead (no NFA state left)
    std::vector<uint64_t> mask;
    bool masked = false;
};

inline Grammar::~Grammar() = default;
inline const std::vector<int>& Grammar::end_ids() const { return trie_->end_ids(); }
inline int Grammar::state_count() const {
    std::lock_guard lock(mutex_);
    return static_cast<int>(states_.size());
}
inline bool Grammar::accepts(int state) const {
    std::lock_guard lock(mutex_);
    return states_[static_cast<size_t>(state)]->accepting;
}
inline bool Grammar::can_continue(int state) const {
    std::lock_guard lock(mutex_);
    return states_[static_cast<size_t>(state)]->consumes;
}
inline const std::vector<uint64_t>& Grammar::mask(int state) const {
    std::lock_guard lock(mutex_);
    return mask_locked(state);
}
inline int Grammar::advance(int state, int token) const {
    const std::string* bytes = trie_->bytes(token);
    if (!bytes) return -1;
    std::lock_guard lock(mutex_);
    for (char c : *bytes) {
        state = step(state, static_cast<uint8_t>(c));
        if (state < 0) return -1;
    }
    return state;
}

// The NFA states reachable from `from` without consuming a byte, keeping those that consume or accept.
inline std::vector<int> Grammar::closure(std::vector<int>& from) const {
    std::vector<int> kept;
    // `seen` is kept between calls and cleared by a new stamp, not refilled: a closure touches a few states of an
    // NFA that may have millions.
    if (seen_.size() != nfa_.states.size()) seen_.assign(nfa_.states.size(), 0);
    if (++stamp_ == 0) {
        std::fill(seen_.begin(), seen_.end(), 0);
        stamp_ = 1;
    }
    while (!from.empty()) {
        const int i = from.back();
        from.pop_back();
        if (seen_[static_cast<size_t>(i)] == stamp_) continue;
        seen_[static_cast<size_t>(i)] = stamp_;
        if (++work_ > max_work)
            fail(description_, ": following this grammar takes more than ", max_work, " automaton steps; simplify it");
        const detail::NfaState& s = nfa_.states[static_cast<size_t>(i)];
        if (s.kind == detail::NfaState::Kind::Split) {
            from.push_back(s.other);
            from.push_back(s.next);
        } else {
            kept.push_back(i);
        }
    }
    std::sort(kept.begin(), kept.end());
    return kept;
}

inline int Grammar::state_for(std::vector<int> nfa) const {
    auto found = index_.find(nfa);
    if (found != index_.end()) return found->second;
    if (states_.size() >= static_cast<size_t>(max_states))
        fail(description_, ": the grammar needs more than ", max_states, " automaton states; simplify it");
    auto state = std::make_unique<State>();
    for (int i : nfa) {
        const auto kind = nfa_.states[static_cast<size_t>(i)].kind;
        state->accepting = state->accepting || kind == detail::NfaState::Kind::Match;
        state->consumes = state->consumes || kind == detail::NfaState::Kind::Byte;
    }
    state->next.fill(-2);
    state->nfa = nfa;
    const int id = static_cast<int>(states_.size());
    states_.push_back(std::move(state));
    index_.emplace(std::move(nfa), id);
    return id;
}

// One byte from `state`: the lazy DFA's transition, built on first use. An empty set of NFA states is dead: every
// state of an NFA built from a simplified expression lies on a path to acceptance, so a non-empty set is alive.
inline int Grammar::step(int state, uint8_t byte) const {
    int& next = states_[static_cast<size_t>(state)]->next[byte];
    if (next != -2) return next;
    std::vector<int> targets;
    for (int i : states_[static_cast<size_t>(state)]->nfa) {
        const detail::NfaState& s = nfa_.states[static_cast<size_t>(i)];
        if (s.kind == detail::NfaState::Kind::Byte && s.lo <= byte && byte <= s.hi) targets.push_back(s.next);
    }
    next = targets.empty() ? -1 : state_for(closure(targets));  // States live on the heap: `next` stays valid
    return next;
}

// The mask: a depth-first walk of the trie alongside the automaton. A token is allowed when the walk reaches its
// node alive; a dead byte cuts off every token below it.
inline const std::vector<uint64_t>& Grammar::mask_locked(int state) const {
    State& s = *states_[static_cast<size_t>(state)];
    if (s.masked) return s.mask;
    std::vector<uint64_t> mask((static_cast<size_t>(trie_->vocab_size()) + 63) / 64, 0);
    bool any = false;
    auto allow = [&](int id) {
        mask[static_cast<size_t>(id) / 64] |= uint64_t{1} << (id % 64);
        any = true;
    };
    if (s.accepting)
        for (int id : trie_->end_ids())
            if (id >= 0 && id < trie_->vocab_size()) allow(id);
    std::vector<std::pair<int, int>> stack = {{0, state}};  // (trie node, automaton state)
    while (!stack.empty()) {
        auto [node, at] = stack.back();
        stack.pop_back();
        for (int child = trie_->nodes_[static_cast<size_t>(node)].first_child; child >= 0;
             child = trie_->nodes_[static_cast<size_t>(child)].next_sibling) {
            const TokenTrie::Node& c = trie_->nodes_[static_cast<size_t>(child)];
            const int after = step(at, c.byte);
            if (after < 0) continue;
            for (int k = c.ids_begin; k >= 0 && k < c.ids_end; ++k) allow(trie_->ids_[static_cast<size_t>(k)]);
            if (c.first_child >= 0) stack.emplace_back(child, after);
        }
    }
    s.mask = any ? std::move(mask) : std::vector<uint64_t>();
    s.masked = true;
    return s.mask;
}

}  // namespace infer
