// 02_weights_on_disk — what a checkpoint holds, and whether the arithmetic accounts for every byte of it.
//
//   02_weights_on_disk [PATH...]      (a Hugging Face folder, a .gguf file or a llama2.c .bin; none: the demo model)
//
// For each model: its format and shape, the parameter count, the dtype, the weight bytes by arithmetic (parameters ×
// bytes per parameter) next to the bytes on disk, where the rest of the file went, and the two per-token costs that
// follow from the shape: the weight bytes one decode step reads and the KV-cache bytes one token occupies.
// A float GGUF is also quantized to Q8_0, Q4_0 and Q4_K_M (infer quantize) and each copy measured: bytes saved, weight
// error, logit error. Exits 1 if any model's weights claim more bytes than its files hold. Chapter 02 walks through it.
#include "infer.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

// 1234567 → "1,234,567": byte counts are compared digit by digit, so they are printed in full.
std::string grouped(uint64_t value) {
    std::string digits = std::to_string(value), out;
    for (size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return out;
}

// Decimal units, as disk sizes and memory bandwidth are quoted.
std::string human(double bytes) {
    const char* units[] = {"B", "kB", "MB", "GB", "TB"};
    int unit = 0;
    while (bytes >= 1000 && unit < 4) {
        bytes /= 1000;
        ++unit;
    }
    char text[32];
    std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.2f %s", bytes, units[unit]);
    return text;
}

// Every distinct weight tensor of the model, once. A tied classifier is the embedding itself, and must not be counted
// twice; the set of data pointers takes care of that.
std::vector<const infer::Tensor*> distinct_tensors(const infer::Model& model) {
    std::vector<const infer::Tensor*> all = {&model.embedding, &model.final_norm, &model.lm_head};
    for (const infer::LayerWeights& layer : model.layers)
        for (const infer::Tensor* t : {&layer.attn_norm, &layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.bq,
                                       &layer.bk, &layer.bv, &layer.q_norm, &layer.k_norm, &layer.ffn_norm,
                                       &layer.w_gate, &layer.w_up, &layer.w_down})
            all.push_back(t);
    std::vector<const infer::Tensor*> distinct;
    std::set<const std::byte*> seen;
    for (const infer::Tensor* t : all)
        if (!t->empty() && seen.insert(t->data).second) distinct.push_back(t);
    return distinct;
}

// Where a file's bytes went: before the first weight (headers), inside the weights' span but not a weight (padding,
// tensors the engine does not use), and after the last weight.
struct FileLayout {
    std::string path;
    uint64_t size = 0, weights = 0, before = 0, between = 0, after = 0;
    int tensors = 0;
};

FileLayout layout_of(const infer::MappedFile& file, const std::vector<const infer::Tensor*>& tensors) {
    FileLayout layout{file.path(), file.size()};
    const std::byte* begin = file.data();
    const std::byte* end = begin + file.size();
    const std::byte* first = end;
    const std::byte* last = begin;
    for (const infer::Tensor* t : tensors) {
        if (t->data < begin || t->data >= end) continue;
        first = std::min(first, t->data);
        last = std::max(last, t->data + t->bytes());
        layout.weights += t->bytes();
        ++layout.tensors;
    }
    if (layout.tensors == 0) return layout;
    layout.before = static_cast<uint64_t>(first - begin);
    layout.after = static_cast<uint64_t>(end - last);
    layout.between = static_cast<uint64_t>(last - first) - layout.weights;
    return layout;
}

// What the bytes around the weights are, in each format's own words.
const char* header_contents(infer::ModelFormat format) {
    switch (format) {
        case infer::ModelFormat::Gguf: return "magic, version, metadata (hyperparameters, vocabulary), tensor table, padding";
        case infer::ModelFormat::HuggingFace: return "8-byte length + JSON header (name, dtype, shape, offsets per tensor)";
        case infer::ModelFormat::Llama2c: return "7 × int32: dim, hidden_dim, layers, heads, kv_heads, vocab, seq_len";
        case infer::ModelFormat::BuiltIn: return "";
    }
    return "";
}

// What else a file carries besides the weights the Model points at.
std::string other_contents(const infer::Model& model, uint64_t bytes) {
    const infer::ModelConfig& c = model.config;
    // llama2.c stores precomputed RoPE tables, freq_cis_real and freq_cis_imag (context × Dh/2 floats each), which
    // this engine recomputes from the positions: the one array in that format the Model does not point at.
    uint64_t freq_cis = static_cast<uint64_t>(c.context_length) * static_cast<uint64_t>(c.head_dim) * 4;
    if (model.format == infer::ModelFormat::Llama2c && bytes == freq_cis)
        return "freq_cis = " + std::to_string(c.context_length) + " × " + std::to_string(c.head_dim) +
               " × 4 B, RoPE tables (recomputed)";
    if (!model.rope_freq_divisors.empty()) return "alignment padding and rope_freqs (read into the RoPE setup)";
    return "alignment padding or tensors the engine does not use";
}

// Returns false when the weights claim more bytes than the files hold.
bool describe(const infer::Model& model) {
    const infer::ModelConfig& c = model.config;
    std::printf("== %s\n", model.source.c_str());
    std::printf("format        %s, architecture %s\n", infer::format_name(model.format), c.architecture.c_str());
    std::printf("shape         D %d  L %d  H %d  Hkv %d  Dh %d  F %d  V %d  context %d\n", c.dim, c.n_layers,
                c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size, c.context_length);
    std::printf("parameters    %s (%s)\n", grouped(static_cast<uint64_t>(model.parameter_count())).c_str(),
                c.tied_embeddings ? "classifier tied to the embedding: stored once"
                                  : "classifier stored apart from the embedding");

    // The arithmetic: elements × bytes per element, per dtype (a file may mix F32 norms with BF16 matrices).
    std::vector<const infer::Tensor*> tensors = distinct_tensors(model);
    std::map<infer::DType, uint64_t> elements_by_dtype;
    for (const infer::Tensor* t : tensors) elements_by_dtype[t->dtype] += static_cast<uint64_t>(t->elements());
    uint64_t weight_bytes = 0, elements = 0;
    std::string dtypes, arithmetic;
    for (auto [dtype, count] : elements_by_dtype) {
        // A type stores `elements` weights in `bytes` bytes: 4/1 for F32, 2/1 for BF16, 34/32 for Q8_0's blocks.
        const infer::DTypeBlock& block = infer::dtype_block(dtype);
        std::string per_parameter = std::to_string(block.bytes) + (block.elements == 1 ? "" : "/" + std::to_string(block.elements));
        weight_bytes += infer::dtype_bytes(dtype, static_cast<int64_t>(count));
        elements += count;
        dtypes += (dtypes.empty() ? "" : " + ") + std::string(infer::dtype_name(dtype)) + " (" + per_parameter +
                  " bytes per parameter)";
        arithmetic += (arithmetic.empty() ? "" : " + ") + grouped(count) + " × " + per_parameter;
    }
    std::printf("dtype         %s\n", dtypes.c_str());
    std::printf("weights       %s = %s B (%s)\n", arithmetic.c_str(), grouped(weight_bytes).c_str(),
                human(static_cast<double>(weight_bytes)).c_str());
    if (elements != static_cast<uint64_t>(model.parameter_count()))
        std::printf("note          the tensors hold %s elements but parameter_count() says %s\n",
                    grouped(elements).c_str(), grouped(static_cast<uint64_t>(model.parameter_count())).c_str());

    bool accounted = true;
    if (model.files.empty()) {
        // The demo model lives in buffers it owns: compare against those instead of a file.
        uint64_t owned = 0;
        for (const auto& buffer : model.owned) owned += buffer.size();
        std::printf("in memory     %s B in %zu buffers (built in: no file)\n", grouped(owned).c_str(),
                    model.owned.size());
        accounted = weight_bytes <= owned;
    } else {
        uint64_t file_bytes = 0, placed = 0;
        for (const auto& file : model.files) {
            FileLayout f = layout_of(*file, tensors);
            file_bytes += f.size;
            placed += f.weights;
            std::printf("on disk       %s B  %s (%d tensors)\n", grouped(f.size).c_str(), f.path.c_str(), f.tensors);
            std::printf("  header      %s B  %s\n", grouped(f.before).c_str(), header_contents(model.format));
            if (f.between > 0 || f.after > 0)
                std::printf("  other       %s B between the weights, %s B after: %s\n", grouped(f.between).c_str(),
                            grouped(f.after).c_str(), other_contents(model, f.between + f.after).c_str());
        }
        int64_t difference = static_cast<int64_t>(file_bytes) - static_cast<int64_t>(weight_bytes);
        std::printf("difference    %s B on disk - %s B of weights = %s%s B (%.1f %% of the file%s)\n",
                    grouped(file_bytes).c_str(), grouped(weight_bytes).c_str(), difference < 0 ? "-" : "",
                    grouped(static_cast<uint64_t>(difference < 0 ? -difference : difference)).c_str(),
                    file_bytes ? 100.0 * static_cast<double>(difference) / static_cast<double>(file_bytes) : 0.0,
                    model.files.size() > 1 ? "s" : "");
        accounted = weight_bytes <= file_bytes && placed == weight_bytes;
        if (placed != weight_bytes)
            std::printf("note          only %s B of the weights lie inside the model's files\n",
                        grouped(placed).c_str());
    }

    // One decode step multiplies one token's activations by every matrix: each weight byte crosses the memory bus once
    // per step, which is why this figure, divided by the memory bandwidth, bounds decode's tokens per second.
    size_t per_token = model.weight_bytes_per_token();
    std::printf("decode reads  %s B of weights per token (%s): every matrix once, one embedding row\n",
                grouped(per_token).c_str(), human(static_cast<double>(per_token)).c_str());
    size_t kv = infer::KVCache::bytes_per_token(c);
    std::printf("KV cache      %s B per token (2 × L × Hkv × Dh × 4 B); %s for the whole %d-token context\n",
                grouped(kv).c_str(), human(static_cast<double>(kv) * c.context_length).c_str(), c.context_length);
    std::printf("\n");
    if (!accounted)
        std::cerr << "error: " << model.source << ": the weights claim " << weight_bytes
                  << " bytes, more than its storage holds\n";
    return accounted;
}

}  // namespace

// The logits of a short prompt (ids valid in any vocabulary of 64 or more), one row per position.
std::vector<float> prompt_logits(const infer::Model& model, infer::ThreadPool& pool) {
    const std::vector<int> ids = {1, 17, 33, 49, 63, 2, 40, 9};
    infer::KVCache cache(model.config, 1, 16);
    if (!cache.reserve(0, static_cast<int>(ids.size()))) throw infer::Error("KV cache too small for the prompt");
    infer::Batch batch;
    for (size_t i = 0; i < ids.size(); ++i) batch.add(ids[i], static_cast<int>(i), 0, true);
    infer::ForwardPass forward(model, pool);
    const std::span<const float> logits = forward.forward(batch, cache);
    return {logits.begin(), logits.end()};
}

// Quantized copies of a float GGUF (infer quantize, appendix I): what each type saves in bytes, and what it costs in
// the weights (RMS error of the matrices, relative to their RMS) and in the logits of a short prompt.
void quantize_and_compare(const std::filesystem::path& path) {
    infer::ThreadPool pool(2);
    const infer::Model original = infer::load_model(path);
    const std::vector<float> exact = prompt_logits(original, pool);
    const infer::GgufFile source = infer::read_gguf(path);
    std::printf("\nquantized copies of %s (infer quantize):\n", path.filename().c_str());
    std::printf("  %-7s %12s %9s  %-26s %14s %14s\n", "type", "file bytes", "smaller", "tensors", "weight error", "max |dlogit|");
    const std::filesystem::path out = std::filesystem::temp_directory_path() /
                                      ("02_weights_on_disk-" + std::to_string(std::random_device{}()) + ".gguf");
    for (const std::string type : {"Q8_0", "Q4_0", "Q4_K_M"}) {
        infer::QuantizeOptions options;
        options.type = type;
        options.pool = &pool;
        const infer::QuantizeReport report = infer::quantize_gguf(path, out, options);
        std::string types;
        for (const auto& [name, count] : report.tensors_by_type) types += (types.empty() ? "" : " ") + std::to_string(count) + "x" + name;
        // The matrices' rounding error, relative to their size: every 2-D tensor, row by row.
        const infer::GgufFile quantized = infer::read_gguf(out);
        double error = 0, size = 0;
        for (const auto& [name, tensor] : source.tensors) {
            if (tensor.shape.size() != 2) continue;
            const infer::Tensor& copy = quantized.tensors.at(name);
            std::vector<float> a(static_cast<size_t>(tensor.cols())), b(a.size());
            for (int64_t r = 0; r < tensor.rows(); ++r) {
                tensor.read_row(r, a.data());
                copy.read_row(r, b.data());
                for (size_t i = 0; i < a.size(); ++i) {
                    error += double(a[i] - b[i]) * double(a[i] - b[i]);
                    size += double(a[i]) * double(a[i]);
                }
            }
        }
        const std::vector<float> logits = prompt_logits(infer::load_model(out), pool);
        double worst = 0;
        for (size_t i = 0; i < logits.size(); ++i) worst = std::max(worst, std::fabs(double(logits[i]) - double(exact[i])));
        std::printf("  %-7s %12s %8.2fx  %-26s %13.2f%% %14.4f\n", type.c_str(), grouped(report.bytes_out).c_str(),
                    static_cast<double>(report.bytes_in) / static_cast<double>(report.bytes_out), types.c_str(),
                    100.0 * std::sqrt(error / std::max(size, 1e-30)), worst);
    }
    std::filesystem::remove(out);
}

int main(int argc, char** argv) try {
    std::vector<std::string> paths;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") {
            std::cout << "usage: " << argv[0] << " [PATH...]   (Hugging Face folder, .gguf, llama2.c .bin)\n";
            return 0;
        }
        if (arg.size() > 1 && arg[0] == '-') throw infer::Error("unknown option \"" + arg + "\" (usage: [PATH...])");
        paths.push_back(arg);
    }

    bool all_accounted = true;
    if (paths.empty()) {
        std::cerr << "note: no path given, so this describes the built-in demo model (random weights)\n";
        all_accounted = describe(infer::demo_model());
    }
    for (const std::string& path : paths) {
        const infer::Model model = infer::load_model(path);
        all_accounted = describe(model) && all_accounted;
        if (model.format == infer::ModelFormat::Gguf && !infer::is_quantized(model.layers.front().wq.dtype))
            quantize_and_compare(path);  // a float GGUF: what quantizing it saves and costs
    }
    return all_accounted ? 0 : 1;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
