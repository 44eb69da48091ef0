// 04_structured_outputs — a JSON Schema becomes a token mask, and what the mask costs per token.
//
//   04_structured_outputs [-m PATH] [--schema FILE] [-n SAMPLES] [--tokens N] [-t THREADS]
//
// Writes the schema (a built-in one of ten fields, or FILE) as a regular expression, compiles it over the model's
// vocabulary, and shows the masks at the first states of an output: how many of the V tokens each state allows.
// Then it samples the same seeds three times through the engine: constrained while the masks are being built (cold),
// constrained again with every mask cached (warm), and unconstrained with each request as long as its constrained
// twin (the same batches, step by step), and prints the time per token of each and the sampler's share of it. Every
// constrained output is parsed back as JSON. Without -m it uses the built-in demo model. Chapter 04 walks through it.
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <iostream>
#include <string>

namespace {

const char* default_schema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "height_m": {"type": "number"},
    "email_verified": {"type": "boolean"},
    "role": {"enum": ["admin", "editor", "viewer"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city"]},
    "manager": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
    "kind": {"const": "user"},
    "joined": {"type": "string", "format": "date"}
  },
  "required": ["name", "age", "role", "kind"]
})";

struct Run {
    double seconds = 0, sample_seconds = 0;
    size_t tokens = 0;
    std::vector<infer::RequestResult> results;
    double ms_per_token() const { return tokens ? 1e3 * seconds / static_cast<double>(tokens) : 0; }
    double sample_ms_per_token() const { return tokens ? 1e3 * sample_seconds / static_cast<double>(tokens) : 0; }
};

// `samples` requests with seeds 0.., all in one engine, run to the end.
Run run(const infer::Model& model, infer::ThreadPool& pool, const std::vector<int>& prompt, int samples,
        const std::function<infer::SamplingParams(int)>& params_for) {
    infer::Engine engine(model, pool);
    std::vector<int> ids;
    for (int i = 0; i < samples; ++i) ids.push_back(engine.add_request(prompt, params_for(i)));
    Run r;
    infer::Stopwatch clock;
    while (engine.has_work()) engine.step();
    r.seconds = clock.seconds();
    for (int id : ids) {
        r.results.push_back(*engine.take_result(id));
        r.tokens += r.results.back().generated_ids.size();
    }
    for (const infer::StepStats& step : engine.steps()) r.sample_seconds += step.sample;  // all the step's samplers
    return r;
}

int count_allowed(const infer::Grammar& grammar, int state) {
    int allowed = 0;
    for (uint64_t word : grammar.mask(state)) allowed += std::popcount(word);
    return allowed;
}

}  // namespace

int main(int argc, char** argv) try {
    CommandLine line(argc, argv, 1, {"-m", "--schema", "-n", "--tokens", "-t"}, {},
                     "usage: 04_structured_outputs [-m PATH] [--schema FILE] [-n SAMPLES] [--tokens N] [-t THREADS]\n");
    const int samples = static_cast<int>(line.integer("-n", 8, 1, 256));
    const int max_tokens = static_cast<int>(line.integer("--tokens", 300, 1, 1 << 20));
    infer::Model model = line.has("-m") ? infer::load_model(line.text("-m")) : infer::demo_model();
    infer::ThreadPool pool(static_cast<int>(line.integer("-t", 0, 0, 1024)));
    const infer::Tokenizer tokenizer = infer::tokenizer_for(model);
    const std::string schema_text = line.has("--schema") ? infer::read_text_file(line.text("--schema")) : default_schema;

    // 1. The schema as a regular expression over the JSON text, and the vocabulary as a trie of byte strings.
    infer::Stopwatch clock;
    const std::string regex = infer::regex_for_json_schema(infer::Json::parse(schema_text, "schema"), "schema");
    const double write_ms = clock.seconds() * 1e3;
    clock.restart();
    auto trie = std::make_shared<const infer::TokenTrie>(tokenizer);
    const double trie_ms = clock.seconds() * 1e3;
    clock.restart();
    auto grammar = std::make_shared<const infer::Grammar>(regex, trie, "schema");
    const double compile_ms = clock.seconds() * 1e3;
    std::printf("model: %s, V = %d tokens; the trie of their bytes: %zu nodes, built in %.1f ms\n", model.source.c_str(),
                trie->vocab_size(), trie->node_count(), trie_ms);
    std::printf("schema → regular expression: %zu characters in %.2f ms; compiled with the start state's mask in %.2f ms\n",
                regex.size(), write_ms, compile_ms);
    std::printf("  begins: %.100s…\n\n", regex.c_str());

    // 2. Masks along one output: each state allows only what can continue the JSON.
    std::printf("%-22s %-16s %s\n", "output so far", "tokens allowed", "(of V)");
    const std::string example = R"({"name": "Ada", "age": 36)";
    int state = infer::Grammar::start;
    size_t at = 0;
    for (size_t cut : {size_t{0}, size_t{1}, size_t{2}, size_t{8}, size_t{10}, size_t{16}, size_t{24}}) {
        for (; at < cut && state >= 0; ++at)  // byte by byte, through each byte's single-byte token
            for (int id = 0; id < trie->vocab_size(); ++id)
                if (const std::string* b = trie->bytes(id); b && b->size() == 1 && (*b)[0] == example[at]) {
                    state = grammar->advance(state, id);
                    break;
                }
        if (state < 0) break;
        std::printf("%-22s %-16d %.2f%%\n", ("'" + example.substr(0, cut) + "'").c_str(), count_allowed(*grammar, state),
                    100.0 * count_allowed(*grammar, state) / trie->vocab_size());
    }

    // 3. The same seeds: constrained (cold masks, then warm), then unconstrained for as many tokens.
    const std::vector<int> prompt = tokenizer.encode("A user record:");
    auto constrained = [&](int i) {
        infer::SamplingParams p;
        p.seed = static_cast<uint64_t>(i);
        p.max_tokens = max_tokens;
        p.grammar = grammar;
        return p;
    };
    run(model, pool, prompt, 1, [](int) {  // a warm-up: the first pass over the weights pays their page faults
        infer::SamplingParams p;
        p.max_tokens = 4;
        return p;
    });
    const int states_before = grammar->state_count();
    const Run cold = run(model, pool, prompt, samples, constrained);
    const int states_after = grammar->state_count();
    const Run warm = run(model, pool, prompt, samples, constrained);
    // Unconstrained, each request as long as its constrained twin: the same batches step by step, so the difference
    // is the constraint's alone.
    const Run free_run = run(model, pool, prompt, samples, [&](int i) {
        infer::SamplingParams p;
        p.seed = static_cast<uint64_t>(i);
        p.max_tokens = std::max<int>(1, static_cast<int>(warm.results[static_cast<size_t>(i)].generated_ids.size()));
        p.ignore_eos = true;
        return p;
    });
    int valid = 0, finished = 0;
    for (const infer::RequestResult& r : warm.results) {
        finished += r.finish_reason == infer::FinishReason::Stop;
        try {
            infer::Json::parse(r.text, "output");
            ++valid;
        } catch (const infer::Error&) {
        }
    }
    std::printf("\n%d samples at temperature 1, %d tokens at most; automaton states built: %d before, %d after\n", samples,
                max_tokens, states_before, states_after);
    std::printf("%-28s %10s %12s %14s\n", "", "tokens", "ms/token", "sampler ms/tok");
    for (const auto& [name, r] : {std::pair<const char*, const Run*>{"constrained, masks cold", &cold},
                                  {"constrained, masks cached", &warm}, {"unconstrained", &free_run}})
        std::printf("%-28s %10zu %12.3f %14.3f\n", name, r->tokens, r->ms_per_token(), r->sample_ms_per_token());
    std::printf("cost of the constraint, cached: %+.3f ms per token (%+.1f%%)\n", warm.ms_per_token() - free_run.ms_per_token(),
                free_run.ms_per_token() > 0 ? 100.0 * (warm.ms_per_token() / free_run.ms_per_token() - 1) : 0.0);
    std::printf("outputs that ended inside the grammar: %d of %d; that parse as JSON: %d\n", finished, samples, valid);
    if (!warm.results.empty()) std::printf("first: %s\n", warm.results.front().text.c_str());
    if (valid != finished) infer::fail("an output that ended inside the grammar did not parse as JSON");
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 1;
}
