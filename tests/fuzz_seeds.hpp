// Seeds for the fuzz targets: small valid inputs of every format, built in code (a tiny random Llama written as GGUF,
// safetensors + config.json and llama2.c, a SentencePiece-style vocabulary, a BPE tokenizer.json, JSON documents,
// chat templates and OpenAI requests). Mutating valid files reaches the deep paths of a parser; mutating random bytes
// mostly tests its first check. Shared by the deterministic run (test_fuzz.cpp) and the libFuzzer seed corpus.
#pragma once

#include "infer.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace fuzz {

using Bytes = std::vector<uint8_t>;

// The tiny model every binary seed describes: 8 wide, one layer, 2 query heads sharing 1 KV head, 32 tokens.
inline infer::ModelShape tiny_shape() {
    infer::ModelShape shape;
    shape.dim = 8;
    shape.n_layers = 1;
    shape.n_heads = 2;
    shape.n_kv_heads = 1;
    shape.ffn_dim = 16;
    shape.vocab_size = 32;
    shape.context_length = 16;
    return shape;
}

// The vocabulary of the seeds: specials, 26 letters, a space piece and a byte token, SentencePiece-style.
inline std::vector<std::string> tiny_pieces() {
    std::vector<std::string> pieces = {"<unk>", "<s>", "</s>", "<0x0A>"};
    for (char c = 'a'; c <= 'z'; ++c) pieces.push_back(std::string(1, c));
    pieces.push_back("\xE2\x96\x81");  // ▁, SentencePiece's space
    pieces.push_back("\xE2\x96\x81" "a");
    return pieces;
}

// ---- GGUF ----------------------------------------------------------------------------------------------------------

class GgufWriter {
public:
    void u32(uint32_t v) { put(&v, 4); }
    void u64(uint64_t v) { put(&v, 8); }
    void f32(float v) { put(&v, 4); }
    void str(const std::string& s) {
        u64(s.size());
        bytes.insert(bytes.end(), s.begin(), s.end());
    }
    void key_u32(const std::string& key, uint32_t v) { str(key), u32(4), u32(v); }
    void key_f32(const std::string& key, float v) { str(key), u32(6), f32(v); }
    void key_str(const std::string& key, const std::string& v) { str(key), u32(8), str(v); }
    void put(const void* data, size_t n) {
        const auto* p = static_cast<const uint8_t*>(data);
        bytes.insert(bytes.end(), p, p + n);
    }
    Bytes bytes;
};

// The tiny model as a GGUF file: llama hyperparameters, a llama (SentencePiece) vocabulary, F32 tensors.
inline Bytes tiny_gguf() {
    const infer::ModelShape shape = tiny_shape();
    std::vector<infer::TensorData> tensors = infer::random_weights(shape, infer::DType::F32, 7);
    auto gguf_name = [](const std::string& name) {
        return infer::detail::renamed_tensor(name, infer::detail::hugging_face_names, infer::detail::gguf_names);
    };
    const std::vector<std::string> pieces = tiny_pieces();
    GgufWriter w;
    w.put("GGUF", 4);
    w.u32(3);
    w.u64(tensors.size());
    w.u64(14);  // metadata keys
    w.key_str("general.architecture", "llama");
    w.key_u32("llama.embedding_length", static_cast<uint32_t>(shape.dim));
    w.key_u32("llama.block_count", static_cast<uint32_t>(shape.n_layers));
    w.key_u32("llama.feed_forward_length", static_cast<uint32_t>(shape.ffn_dim));
    w.key_u32("llama.attention.head_count", static_cast<uint32_t>(shape.n_heads));
    w.key_u32("llama.attention.head_count_kv", static_cast<uint32_t>(shape.n_kv_heads));
    w.key_u32("llama.context_length", static_cast<uint32_t>(shape.context_length));
    w.key_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    w.key_str("tokenizer.ggml.model", "llama");
    w.str("tokenizer.ggml.tokens"), w.u32(9), w.u32(8), w.u64(pieces.size());
    for (const std::string& piece : pieces) w.str(piece);
    w.str("tokenizer.ggml.scores"), w.u32(9), w.u32(6), w.u64(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) w.f32(-static_cast<float>(i));
    w.str("tokenizer.ggml.token_type"), w.u32(9), w.u32(5), w.u64(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) w.u32(i == 0 ? 2 : i < 3 ? 3 : i == 3 ? 6 : 1);
    w.key_u32("tokenizer.ggml.bos_token_id", 1);
    w.key_u32("tokenizer.ggml.eos_token_id", 2);
    uint64_t offset = 0;
    for (const infer::TensorData& t : tensors) {
        w.str(gguf_name(t.name));
        w.u32(static_cast<uint32_t>(t.shape.size()));
        for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) w.u64(static_cast<uint64_t>(*d));  // GGUF: fastest first
        w.u32(0);  // F32
        w.u64(offset);
        offset += (t.bytes.size() + 31) / 32 * 32;
    }
    while (w.bytes.size() % 32) w.bytes.push_back(0);
    for (const infer::TensorData& t : tensors) {
        w.put(t.bytes.data(), t.bytes.size());
        while (w.bytes.size() % 32) w.bytes.push_back(0);
    }
    return w.bytes;
}

// ---- llama2.c ------------------------------------------------------------------------------------------------------

// The tiny model as a llama2.c checkpoint: the 7-int header, then every weight as float32 in the format's order.
inline Bytes tiny_llama2c() {
    const infer::ModelShape s = tiny_shape();
    const int32_t header[7] = {s.dim, s.ffn_dim, s.n_layers, s.n_heads, s.n_kv_heads, s.vocab_size, s.context_length};
    const int64_t D = s.dim, F = s.ffn_dim, L = s.n_layers, V = s.vocab_size, S = s.context_length;
    const int64_t Dh = D / s.n_heads, kv = int64_t{s.n_kv_heads} * Dh;
    const int64_t floats = V * D + L * D + L * D * D + 2 * L * D * kv + L * D * D + L * D + 3 * L * F * D + D + S * Dh;
    Bytes out(sizeof header + static_cast<size_t>(floats) * 4);
    std::memcpy(out.data(), header, sizeof header);
    for (int64_t i = 0; i < floats; ++i) {
        float v = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
        std::memcpy(out.data() + sizeof header + i * 4, &v, 4);
    }
    return out;
}

// llama2.c's tokenizer.bin: u32 max token length, then per token a float score, an int32 length and the bytes.
inline Bytes tiny_llama2c_tokenizer() {
    Bytes out;
    auto put = [&](const void* p, size_t n) { out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n); };
    uint32_t max_length = 8;
    put(&max_length, 4);
    std::vector<std::string> pieces = tiny_pieces();
    pieces[1] = "\n<s>\n";
    pieces[2] = "\n</s>\n";
    for (size_t i = 0; i < pieces.size(); ++i) {
        float score = -static_cast<float>(i);
        int32_t length = static_cast<int32_t>(pieces[i].size());
        put(&score, 4);
        put(&length, 4);
        put(pieces[i].data(), pieces[i].size());
    }
    return out;
}

// ---- safetensors + config.json -------------------------------------------------------------------------------------

inline std::string tiny_config_json() {
    const infer::ModelShape s = tiny_shape();
    return infer::concat(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": )", s.dim,
                         R"(, "intermediate_size": )", s.ffn_dim, R"(, "num_hidden_layers": )", s.n_layers,
                         R"(, "num_attention_heads": )", s.n_heads, R"(, "num_key_value_heads": )", s.n_kv_heads,
                         R"(, "vocab_size": )", s.vocab_size, R"(, "max_position_embeddings": )", s.context_length,
                         R"(, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false, "bos_token_id": 1,)"
                         R"( "eos_token_id": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})");
}

inline Bytes tiny_safetensors(const std::filesystem::path& scratch) {
    infer::save_safetensors(scratch, infer::random_weights(tiny_shape(), infer::DType::BF16, 3));
    std::string text = infer::read_text_file(scratch);
    return Bytes(text.begin(), text.end());
}

// ---- tokenizer.json ------------------------------------------------------------------------------------------------

// A byte-level BPE tokenizer.json in GPT-2's shape: the 256 byte symbols, a few merges, one added token.
inline std::string tiny_tokenizer_json() {
    std::string vocab, merges;
    int id = 0;
    // GPT-2 spells each byte as a printable character: itself where printable, else 256, 257, ... in byte order.
    std::vector<int> codes(256);
    for (int byte = 0, extra = 0; byte < 256; ++byte) {
        bool printable = (byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || (byte >= 174 && byte <= 255);
        codes[byte] = printable ? byte : 256 + extra++;
    }
    auto symbol = [&](int byte) {  // the code point in UTF-8 (at most two bytes here)
        int code = codes[byte];
        std::string out;
        if (code < 0x80) out += static_cast<char>(code);
        else {
            out += static_cast<char>(0xC0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3F));
        }
        return out;
    };
    for (int b = 0; b < 256; ++b) {
        std::string s = symbol(b);
        std::string escaped;
        for (char c : s) escaped += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
        vocab += (id ? ", \"" : "\"") + escaped + "\": " + std::to_string(id);
        ++id;
    }
    for (const char* pair : {"t h", "th e", "\xC4\xA0 t", "\xC4\xA0 the", "a n", "an d"}) {
        std::string joined(pair);
        joined.erase(joined.find(' '), 1);
        vocab += ", \"" + joined + "\": " + std::to_string(id++);
        merges += std::string(merges.empty() ? "" : ", ") + "\"" + pair + "\"";
    }
    return R"({"version": "1.0", "added_tokens": [{"id": )" + std::to_string(id) +
           R"(, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],)"
           R"( "normalizer": null, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},)"
           R"( "post_processor": null, "decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "dropout": null, "unk_token": null,)"
           R"( "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "vocab": {)" +
           vocab + "}, \"merges\": [" + merges + "]}}";
}

// ---- text formats --------------------------------------------------------------------------------------------------

inline std::vector<std::string> json_seeds() {
    return {R"({"a": [1, 2.5e3, -0.0, true, false, null], "b": {"c": "\u00e9\ud83d\ude00\n"}})", "[[[[[]]]]]", "\"x\"",
            "1e308", "-12345678901234567890", R"({"":{"":{"":[{}]}}})"};
}

inline std::vector<std::string> template_seeds() {
    return {
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content|trim }} [/INST]{% else %}"
        "{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
        "{% set ns = namespace(n=0) %}{% for m in messages|reverse %}{% set ns.n = ns.n + loop.index %}{% endfor %}{{ ns.n }}"
        "{{ messages|tojson(indent=2) }}{{ (messages|length) * 2 ** 3 // 5 % 7 }}{{ 'abc'[::-1]|upper }}",
        "{% macro f(x, y=2) %}{{ x ~ y }}{% endmacro %}{{ f(1) }}{{ f('a', y='b') }}{% raw %}{{ raw }}{% endraw %}"
        "{{ 'a,b'.split(',')|join('-') }}{{ range(3)|list }}{{ {'k': 1}.items()|list }}",
    };
}

inline std::vector<std::string> request_seeds() {
    return {
        R"({"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40,)"
        R"( "stop": ["\n", "end"], "seed": 3, "logprobs": 2, "n": 2, "stream": true, "stream_options": {"include_usage": true}})",
        R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_completion_tokens": 4,)"
        R"( "logprobs": true, "top_logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.1})",
        R"({"prompt": [1, 5, 9, 30], "max_tokens": 2, "ignore_eos": true, "repetition_penalty": 1.1})",
        R"({"prompt": ["a", [1, 2]], "echo": true, "best_of": 2, "logit_bias": {"5": -100, "7": 3.5}, "suffix": "x",)"
        R"( "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties":)"
        R"( {"a": {"type": "integer", "minimum": -5, "maximum": 250}, "b": {"enum": ["x", 1, null]}, "c": {"type": "array",)"
        R"( "items": {"$ref": "#/$defs/n"}, "maxItems": 2}}, "required": ["a"], "$defs": {"n": {"anyOf": [{"type": "string",)"
        R"( "maxLength": 3}, {"type": "null"}]}}}}}})",
        R"({"prompt": "x", "guided_regex": "([a-c]{2,3}|\\d+)?[^\\s\"]*(?:x|y)+\\u00e9.", "max_tokens": 3})",
        R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": null,)"
        R"( "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool",)"
        R"( "content": "ok"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",)"
        R"( "properties": {"q": {"type": "string"}}}}}], "tool_choice": "required", "parallel_tool_calls": false,)"
        R"( "chat_template_kwargs": {"x": 1}, "structured_outputs": {"json_object": true}})",
    };
}

}  // namespace fuzz
