// The course's contracts on the header itself: its sections follow the chapters, a reader meets the lessons before
// the plumbing, the lessons are commented, and the quick starts in its opening comment (and in chat_template.hpp's)
// compile and run as standalone files beside the header, as a reader who drops them into a project would build them.
#include "support.hpp"

#include <future>
#include <cmath>
#include <regex>
#include <set>

namespace {

std::filesystem::path source_dir() {
    const char* dir = std::getenv("INFER_SOURCE");
    REQUIRE_MESSAGE(dir != nullptr, "INFER_SOURCE is not set (meson test sets it)");
    return dir;
}

std::vector<std::string> header_lines() {
    std::vector<std::string> lines;
    std::istringstream in(infer::read_text_file(source_dir() / "infer.hpp"));
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
}

struct Section {
    std::string number, title;  // "04", "FORWARD PASS"; appendices are letters
    size_t first_line = 0, end_line = 0;
};

std::vector<Section> sections(const std::vector<std::string>& lines) {
    static const std::regex banner(R"(^// ==== ([0-9]{2}|[A-Z]) (.+?) =+$)");
    std::vector<Section> found;
    for (size_t i = 0; i < lines.size(); ++i) {
        std::smatch m;
        if (!std::regex_match(lines[i], m, banner)) continue;
        if (!found.empty()) found.back().end_line = i;
        found.push_back({m[1], m[2], i, lines.size()});
    }
    return found;
}

size_t first_line_with(const std::vector<std::string>& lines, std::string_view text) {
    for (size_t i = 0; i < lines.size(); ++i)
        if (lines[i].find(text) != std::string::npos) return i;
    FAIL("the header has no line with " << text);
    return 0;
}

// The code block after `heading` in a comment: its lines start with "//   " and end at the next bare "//".
std::string quick_start(const std::string& text, std::string_view heading) {
    size_t at = text.find(heading);
    REQUIRE_MESSAGE(at != std::string::npos, "no quick start headed " << heading);
    std::istringstream in(text.substr(text.find('\n', at) + 1));
    std::string code, line;
    bool started = false;
    while (std::getline(in, line)) {
        if (line == "//") {
            if (started) break;
            continue;
        }
        if (line.rfind("//   ", 0) != 0) break;
        started = true;
        code += line.substr(5) + "\n";
    }
    return code;
}

std::string compiler() {
    const char* cxx = std::getenv("INFER_CXX");
    return cxx ? cxx : "c++";
}

// Compiles `source` in `dir` as the header's quick start says: g++ -std=c++20 -O2 -pthread. Returns the compiler's
// messages, "" on success.
std::string compile(const std::filesystem::path& dir, const std::string& source, const std::string& name) {
    test::write_file(dir / (name + ".cpp"), source);
    std::string command = "cd " + test::quote(dir.string()) + " && " + compiler() + " -std=c++20 -O2 -pthread " + name +
                          ".cpp -o " + name + " > " + name + ".log 2>&1";
    if (std::system(command.c_str()) == 0) return "";
    return "compiling " + name + ".cpp failed:\n" + infer::read_text_file(dir / (name + ".log"));
}

// ---- A chapter's deterministic figures against its program ------------------------------------------------------
// A chapter shows a table from one run of its program. The figures in it that do not depend on the machine (bytes per
// token, waste, hit rates, token and step counts, acceptance) are checked here against a fresh run of the same
// program, so the text cannot go stale when the code changes.

// The chapter's text, chapters/NAME.
std::string chapter_text(std::string_view name) { return infer::read_text_file(source_dir() / "chapters" / std::string(name)); }

// Runs a chapter program of the build (examples/NAME.cpp, built beside the tests) and returns what it printed.
std::string chapter_program_output(const std::string& name, const std::vector<std::string>& args) {
    const char* build = std::getenv("INFER_BUILD");
    REQUIRE_MESSAGE(build != nullptr, "INFER_BUILD is not set (meson test sets it)");
    std::string command = test::quote((std::filesystem::path(build) / name).string());
    for (const std::string& arg : args) command += ' ' + test::quote(arg);
    test::ProgramRun run = test::run_command(command);
    INFO(command);
    INFO(run.err);
    REQUIRE(run.exit_code == 0);
    return run.out;
}

// The first match of `pattern`'s first group in `text`; fails naming the pattern and `where` when there is none.
std::string figure(const std::string& text, const std::string& pattern, std::string_view where) {
    std::smatch m;
    const bool found = std::regex_search(text, m, std::regex(pattern));
    REQUIRE_MESSAGE(found, where << " has no match for " << pattern);
    return m[1];
}

}  // namespace

TEST_CASE("the header's sections are numbered by the chapters that teach them, in order, appendices last") {
    std::vector<std::string> lines = header_lines();
    std::vector<Section> found = sections(lines);
    REQUIRE(found.size() >= 8);
    std::string previous;
    bool in_appendices = false;
    for (const Section& s : found) {
        CAPTURE(s.number);
        bool appendix = std::isalpha(static_cast<unsigned char>(s.number[0]));
        CHECK((appendix || !in_appendices));  // no lesson after the first appendix
        in_appendices = in_appendices || appendix;
        if (!previous.empty() && appendix == std::isalpha(static_cast<unsigned char>(previous[0]))) CHECK(previous < s.number);
        previous = s.number;
        if (appendix) continue;
        // Each numbered section has its chapter, and the chapter opens by pointing at it.
        bool has_chapter = false;
        for (const auto& entry : std::filesystem::directory_iterator(source_dir() / "chapters"))
            has_chapter = has_chapter || entry.path().filename().string().rfind(s.number + "-", 0) == 0;
        CHECK_MESSAGE(has_chapter, "no chapters/" << s.number << "-*.md for section " << s.title);
    }
    CHECK(found.front().number == "01");
}

TEST_CASE("a reader reaches Tokenizer::encode in the first quarter of the header and ForwardPass::forward in the first third") {
    std::vector<std::string> lines = header_lines();
    const double total = static_cast<double>(lines.size());
    const size_t encode = first_line_with(lines, "std::vector<int> encode(std::string_view text, bool add_special_tokens");
    const size_t forward = first_line_with(lines, "std::span<const float> forward(const Batch& batch, KVStorage& cache, const BlockTableOf& table_of) {");
    CHECK(encode / total < 0.25);
    CHECK(forward / total < 1.0 / 3.0);
}

TEST_CASE("every lesson section carries a comment on at least a fifth of its lines") {
    std::vector<std::string> lines = header_lines();
    for (const Section& s : sections(lines)) {
        if (std::isalpha(static_cast<unsigned char>(s.number[0]))) continue;
        int code = 0, commented = 0;
        for (size_t i = s.first_line; i < s.end_line; ++i) {
            const std::string& line = lines[i];
            if (line.find_first_not_of(' ') == std::string::npos) continue;
            ++code;
            commented += line.find("//") != std::string::npos;  // a whole-line comment or one after the code
        }
        CAPTURE(s.title);
        CHECK(commented * 5 >= code);
    }
}

TEST_CASE("every section and appendix that the header, the CUDA file, the chapters, the examples and the README name exists") {
    std::set<std::string> banners;
    for (const Section& s : sections(header_lines())) banners.insert(s.number);
    REQUIRE(banners.count("04"));
    std::vector<std::filesystem::path> files = {"infer.hpp", "infer_cuda.cu", "README.md"};
    for (const char* folder : {"chapters", "examples"})
        for (const auto& entry : std::filesystem::directory_iterator(source_dir() / folder)) files.push_back(entry.path());
    // "section 04", "sections 04 and 05", "appendix F", "appendices A–J": every number or letter in the run.
    const std::regex section(R"(\b[Ss]ections?\s+((?:[0-9]+[a-z]?(?:\s*(?:,|and|or|–|-|to)\s*)?)+))");
    const std::regex appendix(R"(\b[Aa]ppendi(?:x|ces)\s+((?:[A-Z](?![A-Za-z0-9])(?:\s*(?:,|and|or|–|-|to)\s*)?)+))");
    int references = 0;
    for (const std::filesystem::path& file : files) {
        const std::string text = infer::read_text_file(file.is_absolute() ? file : source_dir() / file);
        for (const auto& [pattern, name] : {std::pair{&section, std::regex("[0-9]+[a-z]?")}, std::pair{&appendix, std::regex("[A-Z]")}})
            for (auto m = std::sregex_iterator(text.begin(), text.end(), *pattern); m != std::sregex_iterator(); ++m) {
                const std::string run = (*m)[1];
                for (auto n = std::sregex_iterator(run.begin(), run.end(), name); n != std::sregex_iterator(); ++n) {
                    ++references;
                    const size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + m->position(), '\n'));
                    CHECK_MESSAGE(banners.count(n->str()), file.filename().string() << ":" << line << " names \"" << m->str()
                                                                                    << "\", but the header has no banner " << n->str());
                }
            }
    }
    CHECK(references > 50);  // the course does point into the header
}

TEST_CASE("the quick starts compile as standalone files beside the header, and run") {
    test::TempDir dir("quick-start");
    for (const char* file : {"infer.hpp", "chat_template.hpp"}) std::filesystem::copy_file(source_dir() / file, dir / file);
    const std::string header = infer::read_text_file(source_dir() / "infer.hpp");
    const std::string companion = infer::read_text_file(source_dir() / "chat_template.hpp");
    std::string one_request = quick_start(header, "Quick start, one request");
    std::string engine = quick_start(header, "Quick start, many requests through the engine");
    std::string chat = quick_start(companion, "Quick start:");
    REQUIRE(one_request.find("int main()") != std::string::npos);
    REQUIRE(engine.find("infer::Engine") != std::string::npos);
    // chat_template.hpp's quick start is three statements: wrap them in a program that prints the rendering.
    std::string chat_program = "#include <iostream>\n" + chat.substr(0, chat.find('\n') + 1) + "int main() {\n" +
                               chat.substr(chat.find('\n') + 1) + "std::cout << prompt;\n}\n";

    // Three compilers at once: each takes a while, and the machine has cores for them.
    auto a = std::async(std::launch::async, compile, dir.path(), one_request, "quick");
    auto b = std::async(std::launch::async, compile, dir.path(), engine, "engine");
    auto c = std::async(std::launch::async, compile, dir.path(), chat_program, "chat");
    std::string errors[] = {a.get(), b.get(), c.get()};
    for (const std::string& error : errors) CHECK_MESSAGE(error.empty(), error);

    test::ProgramRun chat_run = test::run_command("cd " + test::quote(dir.path().string()) + " && ./chat");
    CHECK(chat_run.exit_code == 0);
    CHECK(chat_run.out == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n");

    REQUIRE_SHARED_OR_SKIP();
    std::filesystem::copy_file(test::shared_dir() / "models/stories260K/stories260K.gguf", dir / "stories260K.gguf");
    for (const char* program : {"quick", "engine"}) {
        test::ProgramRun run = test::run_command("cd " + test::quote(dir.path().string()) + " && ./" + program);
        CAPTURE(program);
        CAPTURE(run.err);
        CHECK(run.exit_code == 0);
        CHECK(run.out.size() > 20);  // a story, token by token
    }
}

// ---- Each chapter's figures against a fresh run of its program ---------------------------------------------------

namespace {

// `pattern`'s first group must read the same in the chapter's text and in its program's output.
void check_same_figure(const std::string& text, const std::string& output, const std::string& pattern) {
    CAPTURE(pattern);
    CHECK(figure(text, pattern, "the chapter") == figure(output, pattern, "the program's output"));
}

// A figure of the program's output rounded to whole units, as the chapter's prose quotes it.
std::string rounded(const std::string& value) { return std::to_string(std::lround(std::stod(value))); }

std::string stories260K() { return (test::shared_dir() / "models/stories260K/stories260K.gguf").string(); }

}  // namespace

TEST_CASE("chapter 05's deterministic figures match its program") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string text = chapter_text("05-kv-cache.md");
    const std::string out = chapter_program_output("05_kv_cache", {"-m", stories260K(), "--requests", "24"});
    for (const char* pattern : {R"(\(f32\) = (\d+) bytes per token)", R"(context: ([\d.]+ MiB))",
                                R"(Llama 2 7B \(no GQA\)\s+(\d+\s+[\d.]+))", R"(Llama 3 8B \(GQA, 8 KV heads\)\s+(\d+\s+[\d.]+))",
                                R"(Mistral 7B \(GQA, 8 KV heads\)\s+(\d+\s+[\d.]+))",
                                R"(Qwen3 0.6B \(GQA, 8 KV heads\)\s+(\d+\s+[\d.]+))",
                                R"(TinyLlama 1.1B \(GQA, 4 KV heads\)\s+(\d+\s+[\d.]+))", R"(, (\d+) stopped at EOS)",
                                R"(averaged over (\d+) engine steps)", R"(K/V actually stored\s+([\d.]+\s+\d+\s+[\d.]+%))",
                                R"(one full context per slot\s+([\d.]+\s+\d+\s+[\d.]+%))",
                                R"(prompt \+ max_tokens per request\s+([\d.]+\s+\d+\s+[\d.]+%))",
                                R"(paged, blocks of 16 tokens\s+([\d.]+\s+\d+\s+[\d.]+%))",
                                R"(\n   off\s+(\d+\s+\d+ \(\s*[\d.]+%\)\s+\d+))", R"(\n   on\s+(\d+\s+\d+ \([\d.]+%\)\s+\d+))",
                                R"(with and without the cache: (\w+))"})
        check_same_figure(text, out, pattern);
    // The prose quotes the same run.
    CHECK(figure(text, R"(context\s+wastes\s+(\d+)\s+%)", "chapter 05") ==
          rounded(figure(out, R"(one full context per slot\s+[\d.]+\s+\d+\s+([\d.]+)%)", "05_kv_cache")));
    CHECK(figure(text, R"(max_tokens\s+still\s+wastes\s+(\d+)\s+%)", "chapter 05") ==
          rounded(figure(out, R"(prompt \+ max_tokens per request\s+[\d.]+\s+\d+\s+([\d.]+)%)", "05_kv_cache")));
    CHECK(figure(text, R"(Paging\s+wastes\s+(\d+)\s+%)", "chapter 05") ==
          rounded(figure(out, R"(paged, blocks of 16 tokens\s+[\d.]+\s+\d+\s+([\d.]+)%)", "05_kv_cache")));
    const std::string hits = figure(out, R"(\n   on\s+\d+\s+(\d+) \()", "05_kv_cache");
    CHECK(figure(text, R"(=\s+(\d+)\s+hits\))", "chapter 05") == hits);
    CHECK(std::to_string(std::stoi(figure(text, R"(\((\d+)\s+×\s+96\s+=)", "chapter 05")) * 96) == hits);
    CHECK(figure(text, R"(hit\s+rate\s+is\s+([\d.]+)\s+%)", "chapter 05") == figure(out, R"(\n   on\s+\d+\s+\d+ \(([\d.]+)%\))", "05_kv_cache"));
    CHECK(figure(text, R"(falls\s+from\s+(\d+)\s+tokens)", "chapter 05") == figure(out, R"(\n   on\s+(\d+))", "05_kv_cache"));
    CHECK(figure(text, R"(tokens\s+to\s+(\d+))", "chapter 05") == figure(out, R"(\n   on\s+\d+\s+\d+ \([\d.]+%\)\s+(\d+))", "05_kv_cache"));
}

TEST_CASE("chapter 02's deterministic figures match its program") {
    REQUIRE_SHARED_OR_SKIP();
    const std::filesystem::path shared = test::shared_dir();
    const std::string text = chapter_text("02-weights-on-disk.md");
    const std::string out = chapter_program_output(
        "02_weights_on_disk", {stories260K(), (shared / "models/stories260K/stories260K.bin").string(),
                               (shared / "fixtures/arch/llama/model-bf16").string()});
    // The run's table, model by model: every line but the paths is fixed by the files.
    for (const char* pattern :
         {R"(stories260K.gguf\n[^\n]*\nshape\s+([^\n]+))", R"(stories260K.gguf\n(?:[^\n]*\n){2}parameters\s+([^\n]+))",
          R"(stories260K.gguf\n(?:[^\n]*\n){4}weights\s+([^\n]+))", R"(stories260K.gguf\n(?:[^\n]*\n){5}on disk\s+([\d,]+ B))",
          R"(stories260K.gguf\n(?:[^\n]*\n){6}  header\s+([^\n]+))", R"(stories260K.gguf\n(?:[^\n]*\n){7}difference\s+([^\n]+))",
          R"(stories260K.gguf\n(?:[^\n]*\n){8}decode reads\s+([^\n]+))", R"(stories260K.gguf\n(?:[^\n]*\n){9}KV cache\s+([^\n]+))",
          R"(\n  Q8_0 +(\d[^\n]+))", R"(\n  Q4_0 +(\d[^\n]+))", R"(\n  Q4_K_M +(\d[^\n]+))",
          R"(stories260K.bin\n[^\n]*\nshape\s+([^\n]+))", R"(stories260K.bin\n(?:[^\n]*\n){2}parameters\s+([^\n]+))",
          R"(stories260K.bin\n(?:[^\n]*\n){4}weights\s+([^\n]+))", R"(stories260K.bin\n(?:[^\n]*\n){5}on disk\s+([\d,]+ B))",
          R"(stories260K.bin\n(?:[^\n]*\n){7}  other\s+([^\n]+))", R"(stories260K.bin\n(?:[^\n]*\n){8}difference\s+([^\n]+))",
          R"(stories260K.bin\n(?:[^\n]*\n){9}decode reads\s+([^\n]+))", R"(stories260K.bin\n(?:[^\n]*\n){10}KV cache\s+([^\n]+))",
          R"(model-bf16\n[^\n]*\nshape\s+([^\n]+))", R"(model-bf16\n(?:[^\n]*\n){2}parameters\s+([^\n]+))",
          R"(model-bf16\n(?:[^\n]*\n){4}weights\s+([^\n]+))", R"(model-bf16\n(?:[^\n]*\n){5}on disk\s+([\d,]+ B))",
          R"(model-bf16\n(?:[^\n]*\n){7}difference\s+([^\n]+))", R"(model-bf16\n(?:[^\n]*\n){8}decode reads\s+([^\n]+))",
          R"(model-bf16\n(?:[^\n]*\n){9}KV cache\s+([^\n]+))"})
        check_same_figure(text, out, pattern);

    // The prose: the arithmetic's result is the llama2.c file's count, the GGUF's extra classifier the difference.
    const auto number = [](std::string s) {
        s.erase(std::remove(s.begin(), s.end(), ','), s.end());
        return std::stoll(s);
    };
    const std::string bin_parameters = figure(out, R"(stories260K.bin\n(?:[^\n]*\n){2}parameters\s+([\d,]+))", "02 output");
    const std::string gguf_parameters = figure(out, R"(stories260K.gguf\n(?:[^\n]*\n){2}parameters\s+([\d,]+))", "02 output");
    CHECK(figure(text, R"(\*\*([\d,]+) parameters, [\d,]+\nbytes in f32\*\*)", "chapter 02") == bin_parameters);
    CHECK(number(figure(text, R"(\*\*[\d,]+ parameters, ([\d,]+)\nbytes in f32\*\*)", "chapter 02")) == 4 * number(bin_parameters));
    CHECK(number(figure(text, R"(([\d,]+) more parameters on\s+disk)", "chapter 02")) ==
          number(gguf_parameters) - number(bin_parameters));
    CHECK(figure(text, R"(GGUF: (\d+) kB of metadata)", "chapter 02") ==
          std::to_string(number(figure(out, R"(stories260K.gguf\n(?:[^\n]*\n){6}  header\s+([\d,]+) B)", "02 output")) / 1000));
    CHECK(figure(text, R"(header and ([\d,]+) bytes after the last weight)", "chapter 02") ==
          figure(out, R"(([\d,]+) B after: freq_cis)", "02 output"));
    CHECK(figure(text, R"((\d+) % of\s+rounding error in its weights \(Q4_0\))", "chapter 02") ==
          rounded(figure(out, R"(  Q4_0\s+[\d,]+\s+[\d.]+x\s+[^\n]*?([\d.]+)%)", "02 output")));
    CHECK(figure(text, R"(moves a logit by ([\d.]+))", "chapter 02") ==
          [&] {
              char buffer[16];
              std::snprintf(buffer, sizeof buffer, "%.1f", std::stod(figure(out, R"(  Q4_0\s+[^\n]*%\s+([\d.]+))", "02 output")));
              return std::string(buffer);
          }());

    // The worked Q8_0 block is the fixture file's first block of token_embd.weight, byte for byte.
    infer::GgufFile q8 = infer::read_gguf(shared / "fixtures/quant/Q8_0/model-Q8_0.gguf");
    const infer::Tensor& embedding = q8.tensors.at("token_embd.weight");
    std::string hex;
    for (int i = 0; i < 34; ++i) {
        char byte[4];
        std::snprintf(byte, sizeof byte, "%02x", static_cast<unsigned>(embedding.data[i]));
        hex += std::string(i == 0 ? "" : i == 2 ? " | " : " ") + byte;
    }
    CHECK(figure(text, R"(```\n([0-9a-f]{2} [0-9a-f]{2} \| [0-9a-f ]+)\n  d   \| q\[0\.\.31\])", "chapter 02") == hex);
    // And the worked Q4_K block's first 18 bytes: d, dmin, the 12 bytes of scales and minimums, two bytes of qs.
    infer::GgufFile q4k = infer::read_gguf(shared / "fixtures/quant/Q4_K/model-Q4_K.gguf");
    const infer::Tensor& embedding_q4k = q4k.tensors.at("token_embd.weight");
    hex.clear();
    for (int i = 0; i < 18; ++i) {
        char byte[4];
        std::snprintf(byte, sizeof byte, "%02x", static_cast<unsigned>(embedding_q4k.data[i]));
        hex += std::string(i == 0 ? "" : i == 2 || i == 4 || i == 16 ? " | " : " ") + byte;
    }
    CHECK(figure(text, R"(```\n([0-9a-f]{2} [0-9a-f]{2} \| [0-9a-f]{2} [0-9a-f]{2} \| [0-9a-f ]+ \| [0-9a-f]{2} [0-9a-f]{2}) \.\.\.\n)",
                 "chapter 02") == hex);
}

TEST_CASE("chapter 03's deterministic figures match its program") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string text = chapter_text("03-tokenizer.md");
    const std::string out = chapter_program_output(
        "03_tokenizer", {"--tokenizers", (test::shared_dir() / "tokenizers").string(), "-m", stories260K()});
    for (const char* pattern : {R"(\n(    0  \[[^\n]+))", R"(\n(    1  \[[^\n]+))", R"(\n(    2  \[[^\n]+))",
                                R"(\n(   10  \[[^\n]+))", R"(\n(   11  \[[^\n]+))", R"((Llama 2 decodes them as: [^\n]+))",
                                R"((Mistral decodes them as: [^\n]+))", R"((\d+ of \d+) tokens differ)",
                                R"(Encode speed on ([\d.]+ MB))", R"(Llama 2\s+[\d.]+\s+(\d+))", R"(Llama 3\s+[\d.]+\s+(\d+))"})
        check_same_figure(text, out, pattern);
}

TEST_CASE("chapter 04's deterministic figures match its programs") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string text = chapter_text("04-forward-pass.md");
    const std::string forward =
        chapter_program_output("04_forward_pass", {"-m", stories260K(), "--prompt-tokens", "64", "--decode-tokens", "32"});
    // The stories260K table: the model, the tokens, the bytes per step and the intensities; then every sampler line
    // but the one that times it.
    for (const char* pattern :
         {R"((?:^|\n)model\s+\S+stories260K.gguf (\([^\n]+))", R"(\nprefill\s+(\d+) )", R"(\ndecode\s+(\d+) )",
          R"(decode reads\s+([\d.]+ MB))", R"(\nintensity\s+([^\n]+))", R"(\n(prompt\s+[^\n]+))", R"(\n(sampler\s+[^\n]+))",
          R"(\n(  greedy\s+[^\n]+))", R"(\n(  next\s+[^\n]+))", R"(\n(  temperature  0.5[^\n]+))",
          R"(\n(  temperature  1.0[^\n]+))", R"(\n(  temperature  1.5[^\n]+))", R"(\n(  top-k 40[^\n]+))",
          R"(\n(  top-p 0.95[^\n]+))", R"(\n(  min-p 0.05[^\n]+))", R"(\n(  repetition[^\n]+))", R"(\n(  seed 7 [^\n]+))",
          R"(\n(  seed 7 again[^\n]+))", R"(\n(  seed 8[^\n]+))"})
        check_same_figure(text, forward, pattern);
    // The prose quotes the same run.
    CHECK(figure(text, R"(([\d.]+) FLOP per byte in decode)", "chapter 04") ==
          figure(forward, R"(intensity\s+decode ([\d.]+))", "04_forward_pass"));
    CHECK(figure(text, R"(([\d.]+) in a 64-token prefill)", "chapter 04") ==
          figure(forward, R"(prefill ([\d.]+) FLOP/byte)", "04_forward_pass"));
    CHECK(figure(text, R"(([\d.]+) % of the probability sits on two)", "chapter 04") ==
          figure(forward, R"(min-p 0.05   keeps 2 tokens \([^)]*\), ([\d.]+) %)", "04_forward_pass"));

    const std::string structured = chapter_program_output("04_structured_outputs", {"-m", stories260K(), "-n", "4"});
    for (const char* pattern :
         {R"(V = (\d+ tokens; the trie of their bytes: \d+ nodes))", R"(regular expression: (\d+ characters))",
          R"(\n(  begins: [^\n]+))", R"(\n(''\s+\d+\s+[\d.]+%))", R"(\n('\{'\s+\d+\s+[\d.]+%))",
          R"(\n('\{"'\s+\d+\s+[\d.]+%))", R"(\n('\{"name":'\s+\d+\s+[\d.]+%))", R"(\n('\{"name": "'\s+\d+\s+[\d.]+%))",
          R"(\n('\{"name": "Ada", '\s+\d+\s+[\d.]+%))", R"(\n('\{"name": "Ada", "age": 3'\s+\d+\s+[\d.]+%))",
          R"(\n(\d+ samples at temperature 1, [^\n]+))", R"(masks cold\s+(\d+))", R"(masks cached\s+(\d+))",
          R"(unconstrained\s+(\d+))", R"((outputs that ended inside the grammar: [^\n]+))", R"(\n(first: [^\n]+))"})
        check_same_figure(text, structured, pattern);
}

TEST_CASE("chapter 01's deterministic figures match its program") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string text = chapter_text("01-the-stack.md");
    const std::string out =
        chapter_program_output("01_the_stack", {"-m", stories260K(), "-p", "Once upon a time", "-n", "24"});
    // The greedy text, the model, the token counts: everything in the run but the times.
    for (const char* pattern : {R"((?:^|\n)(Once upon a time[^\n]*))", R"(\((gguf, llama, [\d.]+ M parameters)\))",
                                R"((prompt \d+ tokens, generated \d+ tokens, finish: \w+))",
                                R"(prefill\s+[\d.]+ ms\s+[\d.]+ %\s+(\d+) tokens)", R"(decode\s+[\d.]+ ms\s+[\d.]+ %\s+(\d+) tokens)"})
        check_same_figure(text, out, pattern);
    CHECK(figure(text, R"(The prompt is (\d+) tokens because BOS)", "chapter 01") ==
          figure(out, R"(prompt (\d+) tokens)", "01_the_stack"));
}

TEST_CASE("chapter 06's deterministic figures match its programs") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string text = chapter_text("06-scheduler.md");
    const std::string scheduler = chapter_program_output("06_scheduler", {"-m", stories260K(), "--requests", "12"});
    // Steps and sequences per step are the scheduler's decisions; the preemptions too. The times are the machine's.
    for (const char* pattern :
         {R"((\d+ requests \(prompts [^\n]+))", R"(one at a time\s+(\d+\s+[\d.]+))", R"(static\s+(\d+\s+[\d.]+))",
          R"(continuous\s+(\d+\s+[\d.]+))", R"((every policy produced the same ids for every request))",
          R"((Chunked prefill: [^\n]+))", R"(\n   (1088|256|64) )", R"((Preemption: [^\n]+))", R"(\n(   step\s+9: [^\n]+))",
          R"(\n(   step\s+25: [^\n]+))", R"(\n(   step\s+41: [^\n]+))", R"(\n(   step\s+76: [^\n]+))",
          R"(\n(   \d+ preemptions in [^\n]+))", R"((outputs identical to a run with room for all: \w+))"})
        check_same_figure(text, scheduler, pattern);
    // The prose quotes the same run.
    CHECK(figure(text, R"(a step per output token, (\d+))", "chapter 06") == figure(scheduler, R"(one at a time\s+(\d+))", "06_scheduler"));
    CHECK(figure(text, R"(static batching runs them in (\d+) steps)", "chapter 06") ==
          figure(scheduler, R"(static\s+(\d+))", "06_scheduler"));
    CHECK(figure(text, R"(continuous batching in (\d+))", "chapter 06") == figure(scheduler, R"(continuous\s+(\d+))", "06_scheduler"));
    CHECK(figure(text, R"(\(([\d.]+) sequences per step instead)", "chapter 06") ==
          figure(scheduler, R"(continuous\s+\d+\s+([\d.]+))", "06_scheduler"));
    CHECK(figure(text, R"(sequences per step instead\s+of ([\d.]+)\))", "chapter 06") ==
          figure(scheduler, R"(static\s+\d+\s+([\d.]+))", "06_scheduler"));
    CHECK(figure(text, R"(the pool runs out (\w+)\s+times)", "chapter 06") == "four");
    char ratio[16];
    std::snprintf(ratio, sizeof ratio, "%.1f",
                  std::stod(figure(scheduler, R"(one at a time\s+(\d+))", "06")) / std::stod(figure(scheduler, R"(continuous\s+(\d+))", "06")));
    CHECK(figure(text, R"(([\d.]+)× fewer steps than one at\s+a time)", "chapter 06") == ratio);
    CHECK(figure(scheduler, R"((\d+) preemptions in)", "06_scheduler") == "4");

    const std::string speculative =
        chapter_program_output("06_speculative_decoding", {"-m", stories260K(), "-n", "48", "-k", "2,4"});
    // Steps, tokens per step and the share of guesses kept follow from the ids; the step costs and tok/s do not.
    for (const char* pattern :
         {R"((copy-heavy: [^\n]+))", R"(copy-heavy: [^\n]+\n[^\n]+\n   none\s+(\d+\s+[\d.]+))",
          R"(copy-heavy: [^\n]+\n(?:[^\n]+\n){2}   2\s+(\d+\s+[\d.]+\s+[\d.]+%))",
          R"(copy-heavy: [^\n]+\n(?:[^\n]+\n){3}   4\s+(\d+\s+[\d.]+\s+[\d.]+%))", R"((story: [^\n]+))",
          R"(story: [^\n]+\n[^\n]+\n   none\s+(\d+\s+[\d.]+))", R"(story: [^\n]+\n(?:[^\n]+\n){2}   2\s+(\d+\s+[\d.]+\s+[\d.]+%))",
          R"(story: [^\n]+\n(?:[^\n]+\n){3}   4\s+(\d+\s+[\d.]+\s+[\d.]+%))", R"((Draft model: the target's first layers \([^)]+\)))",
          R"(Draft model: [^\n]+\n[^\n]+\n[^\n]+\n   none\s+(\d+\s+[\d.]+))",
          R"(Draft model: [^\n]+\n(?:[^\n]+\n){3}   2\s+(\d+\s+[\d.]+\s+[\d.]+%))",
          R"(Draft model: [^\n]+\n(?:[^\n]+\n){4}   4\s+(\d+\s+[\d.]+\s+[\d.]+%))"})
        check_same_figure(text, speculative, pattern);
    // Every table ends with the exactness check, in the chapter as in the run.
    const auto count = [](const std::string& s, const std::string& what) {
        size_t n = 0;
        for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
        return n;
    };
    CHECK(figure(text, R"(lookup keeps ([\d.]+) % of its guesses at k 2)", "chapter 06") ==
          figure(speculative, R"(copy-heavy: [^\n]+\n(?:[^\n]+\n){2}   2\s+\d+\s+[\d.]+\s+([\d.]+)%)", "06_speculative_decoding"));
    CHECK(figure(text, R"(and (\d+) steps become \d+)", "chapter 06") ==
          figure(speculative, R"(copy-heavy: [^\n]+\n[^\n]+\n   none\s+(\d+))", "06_speculative_decoding"));
    CHECK(figure(text, R"(steps become (\d+))", "chapter 06") ==
          figure(speculative, R"(copy-heavy: [^\n]+\n(?:[^\n]+\n){2}   2\s+(\d+))", "06_speculative_decoding"));
    CHECK(figure(text, R"(on the plain story it keeps ([\d.]+) %)", "chapter 06") ==
          figure(speculative, R"(story: [^\n]+\n(?:[^\n]+\n){2}   2\s+\d+\s+[\d.]+\s+([\d.]+)%)", "06_speculative_decoding"));
    CHECK(figure(text, R"(keeps (none) of its guesses)", "chapter 06") == "none");
    CHECK(figure(speculative, R"(Draft model: [^\n]+\n(?:[^\n]+\n){3}   2\s+\d+\s+[\d.]+\s+([\d.]+)%)", "06") == "0.0");
    CHECK(count(speculative, "every k gave the ids of the plain run, token for token") == 3);
    CHECK(count(text, "every k gave the ids of the plain run, token for token") == 3);
}

TEST_CASE("chapter 04's 110M table has the parameters and bytes its make-model shape implies") {
    // The table comes from a 438 MB model too large to rebuild in a test; its deterministic figures follow from the
    // shape on the make-model line, so they are checked against that arithmetic (f32, classifier tied).
    const std::string text = chapter_text("04-forward-pass.md");
    const std::string line = figure(text, R"((make-model -o m110 [^\n]+))", "chapter 04");
    const auto flag = [&](const std::string& name) { return std::stoll(figure(line, "--" + name + " (\\d+)", "make-model")); };
    const long long D = flag("dim"), L = flag("layers"), F = flag("ffn"), V = flag("vocab");
    REQUIRE(flag("heads") > 0);
    const long long per_layer = 4 * D * D + 3 * D * F + 2 * D;  // q, k, v, o (no GQA); gate, up, down; two norms
    const long long parameters = V * D + L * per_layer + D;      // embedding (the classifier too), layers, final norm
    const long long bytes_per_token = 4 * (parameters + D);  // every matrix once, norms included, one embedding row
    char expected[64];
    std::snprintf(expected, sizeof expected, "%.2f M parameters", static_cast<double>(parameters) / 1e6);
    CHECK(figure(text, R"(m110 \(safetensors, ([\d.]+ M parameters))", "chapter 04") == expected);
    std::snprintf(expected, sizeof expected, "%.3f MB", static_cast<double>(bytes_per_token) / 1e6);
    CHECK(figure(text, R"(m110 \(safetensors[\s\S]*?decode reads\s+([\d.]+ MB))", "chapter 04") == expected);
    CHECK(figure(text, R"(streams (\d+) MB of weights per token)", "chapter 04") ==
          std::to_string(std::lround(static_cast<double>(bytes_per_token) / 1e6)));
    // The KV cache at 4,000 positions: 2 × L × D × 4 bytes a position.
    CHECK(figure(text, R"(= ([\d.]+) KB per position in f32)", "chapter 04") ==
          [&] { char b[16]; std::snprintf(b, sizeof b, "%.1f", 2.0 * L * D * 4 / 1e3); return std::string(b); }());
    CHECK(figure(text, R"(at 4,000 positions a decode step reads (\d+) MB of cache)", "chapter 04") ==
          std::to_string(std::lround(4000.0 * 2 * L * D * 4 / 1e6)));
}

TEST_CASE("chapter 08's deterministic figures match its program") {
    REQUIRE_SHARED_OR_SKIP();
    const char* build = std::getenv("INFER_BUILD");
    REQUIRE(build != nullptr);
    if (!std::filesystem::exists(std::filesystem::path(build) / "08_serving")) return;  // built only with cpp-httplib
    const std::string text = chapter_text("08-serving.md");
    const std::string out = chapter_program_output(
        "08_serving", {"--infer", (std::filesystem::path(build) / "infer").string(), "-m", stories260K(), "-t", "1",
                       "--max-seqs", "4", "--tokens", "64"});
    // The layers a request is timed in, the tokens, and who was admitted; not the times.
    for (const char* pattern : {R"((One request through every layer \(\d+ tokens, streamed\)))", R"(end to end [\d.]+ ms, (\d+ tokens))",
                                R"((Twice the capacity at once: \d+ streamed requests against --max-seqs \d+))",
                                R"(--max-queue 64\s+(\d+ accepted,\s+\d+ got 429))", R"(--max-queue 0\s+(\d+ accepted,\s+\d+ got 429))"})
        check_same_figure(text, out, pattern);
    const auto layers = [](const std::string& s) {
        std::string names;
        static const std::regex layer(R"(\n  ([a-z_]+_ms) )");
        for (auto it = std::sregex_iterator(s.begin(), s.end(), layer); it != std::sregex_iterator(); ++it) names += (*it)[1].str() + " ";
        return names;
    };
    CHECK(layers(text) == layers(out));
}

TEST_CASE("chapter 09's deterministic figures match its program") {
    const char* build = std::getenv("INFER_BUILD");
    REQUIRE(build != nullptr);
    if (!std::filesystem::exists(std::filesystem::path(build) / "09_routing")) return;  // built only with cpp-httplib
    const std::string text = chapter_text("09-routing.md");
    const std::string out = chapter_program_output(
        "09_routing", {"--infer", (std::filesystem::path(build) / "infer").string(), "-t", "1", "--instances", "2", "--groups",
                       "4", "--per-group", "8", "--concurrency", "4", "--kv-blocks", "96"});
    // The workload is fixed by the command; the hit rates and times depend on which requests ran side by side.
    check_same_figure(text, out, R"((\d+ instances, \d+ groups x \d+ requests sharing a \d+-character prefix, \d+ at a time))");
    for (const char* policy : {"round-robin", "least-loaded", "prefix"}) {
        CAPTURE(policy);
        const std::string pattern = std::string("\n  ") + policy + R"( [^\n]* ms\s+(\d+) / (\d+)\n)";
        std::smatch m;
        REQUIRE(std::regex_search(out, m, std::regex(pattern)));
        CHECK(std::stoi(m[1]) + std::stoi(m[2]) == 32);
        REQUIRE(std::regex_search(text, m, std::regex(pattern)));
        CHECK(std::stoi(m[1]) + std::stoi(m[2]) == 32);
    }
    // The prose quotes the table it stands under.
    CHECK(figure(text, R"(prefix policy keeps each system prompt on the instance that already has it: ([\d.]+) %)", "chapter 09") ==
          figure(text, R"(\n  prefix\s+([\d.]+)%)", "chapter 09"));
}

TEST_CASE("chapter 10's deterministic figures match its program") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string text = chapter_text("10-benchmarking.md");
    const std::string out = chapter_program_output("10_benchmarking", {"-m", stories260K()});
    // The five made-up requests: every line of that table and of its summary is arithmetic.
    for (const char* pattern :
         {R"(\n(\| 1 \|[^\n]+))", R"(\n(\| 2 \|[^\n]+))", R"(\n(\| 3 \|[^\n]+))", R"(\n(\| 4 \|[^\n]+))", R"(\n(\| 5 \|[^\n]+))",
          R"(\n(TTFT mean [^\n]+))", R"(\n(TPOT over the [^\n]+))", R"(\n(throughput [\d.]+ req/s, [^\n]+))",
          R"((engine, \d+ prompt \+ \d+ output tokens per request))", R"(\n\|\s+(1|4|16) \|\s+[\d.]+ \|)"})
        check_same_figure(text, out, pattern);
    // The prose's worked percentile is the program's.
    CHECK(figure(text, R"(so\s+200 \+ 0.6 · 600 = (\d+) ms)", "chapter 10") == figure(out, R"(p90 (\d+) ms)", "10_benchmarking"));
}

TEST_CASE("chapter 07's figures for stories260K match its program") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string out = chapter_program_output("07_hardware", {"-m", stories260K(), "--quick"});
    // The figures that depend only on the model's shape, quoted in the chapter's section on small models; the
    // timings around them depend on the machine and are not checked.
    const std::string chapter = chapter_text("07-hardware.md");
    const size_t section = chapter.find("## Small models live in the caches");
    REQUIRE(section != std::string::npos);
    const std::string text = chapter.substr(section);
    const std::string where = "chapter 07's section on small models";
    const std::string number = R"(([0-9]+(?:\.[0-9]+)?))";  // not the full stop after a figure
    CHECK(figure(text, R"(Its\s+)" + number + R"(\s+M\s+parameters)", where) ==
          figure(out, ", " + number + " M parameters", "07_hardware"));
    CHECK(figure(text, R"(parameters\s+are\s+)" + number + R"(\s+MB)", where) ==
          figure(out, number + " MB of weights read per forward pass", "07_hardware"));
    // The FLOP/byte column of a table row: phase, seqs, tokens, ms/pass, FLOP/byte.
    auto intensity = [&](const std::string& phase, int seqs, int tokens) {
        return figure(out, R"(\| )" + phase + R"( +\| +)" + std::to_string(seqs) + R"( \| +)" + std::to_string(tokens) +
                               R"( \| +[0-9.]+ \| +)" + number + R"( \|)",
                      "07_hardware");
    };
    CHECK(figure(text, R"(decode\s+of\s+one\s+sequence\s+does\s+)" + number + R"(\s+FLOP)", where) == intensity("decode", 1, 1));
    CHECK(figure(text, R"(batch\s+of\s+16\s+sequences\s+)" + number, where) == intensity("decode", 16, 16));
    CHECK(figure(text, R"(prefill\s+of\s+64\s+tokens\s+)" + number, where) == intensity("prefill", 1, 64));
}
