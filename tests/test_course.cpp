// The course's contracts on the header itself: its sections follow the chapters, a reader meets the lessons before
// the plumbing, the lessons are commented, and the quick starts in its opening comment (and in chat_template.hpp's)
// compile and run as standalone files beside the header, as a reader who drops them into a project would build them.
#include "support.hpp"

#include <future>
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

TEST_CASE("chapter 07's figures for stories260K match its program") {
    REQUIRE_SHARED_OR_SKIP();
    // Run beside the model with its bare name: print_roofline writes its first two lines through a 256-byte buffer,
    // and a long model path would cut the weight bytes off the end of the second.
    const char* build = std::getenv("INFER_BUILD");
    REQUIRE_MESSAGE(build != nullptr, "INFER_BUILD is not set (meson test sets it)");
    const std::string command = "cd " + test::quote((test::shared_dir() / "models/stories260K").string()) + " && " +
                                test::quote(std::filesystem::absolute(std::filesystem::path(build) / "07_hardware").string()) +
                                " -m stories260K.gguf --quick";
    const test::ProgramRun run = test::run_command(command);
    INFO(command);
    INFO(run.err);
    REQUIRE(run.exit_code == 0);
    const std::string& out = run.out;
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
