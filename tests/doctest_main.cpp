// The tests' main: doctest's, plus a listener that gathers the cases skipped for want of the reference data (see
// REQUIRE_SHARED_OR_SKIP in support.hpp) and says so in one line at the end of the run, rather than once per case.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace test {

namespace {
std::string current_case;
std::vector<std::string> skipped;
}  // namespace

void note_skipped_for_want_of_data() { skipped.push_back(current_case); }

namespace {

struct SkipListener : doctest::IReporter {
    explicit SkipListener(const doctest::ContextOptions& options) : binary(options.binary_name.c_str()) {}

    void test_case_start(const doctest::TestCaseData& data) override { current_case = data.m_name; }
    void test_run_end(const doctest::TestRunStats&) override {
        if (skipped.empty()) return;
        std::string names;
        for (const std::string& name : skipped) names += "\n  - " + name;
        const size_t slash = binary.find_last_of('/');
        std::fprintf(stderr,
                     "SKIPPED %zu test case%s of %s: they check against the reference data, which was not found (the "
                     "folder ../shared beside the checkout; or meson setup -Dshared_dir=PATH, or INFER_SHARED=PATH for a "
                     "test program run by hand; README.md, \"Test data\", says where it comes from):%s\n",
                     skipped.size(), skipped.size() == 1 ? "" : "s", binary.substr(slash == std::string::npos ? 0 : slash + 1).c_str(),
                     names.c_str());
    }

    void report_query(const doctest::QueryData&) override {}
    void test_run_start() override {}
    void test_case_reenter(const doctest::TestCaseData&) override {}
    void test_case_end(const doctest::CurrentTestCaseStats&) override {}
    void test_case_exception(const doctest::TestCaseException&) override {}
    void subcase_start(const doctest::SubcaseSignature&) override {}
    void subcase_end() override {}
    void log_assert(const doctest::AssertData&) override {}
    void log_message(const doctest::MessageData&) override {}
    void test_case_skipped(const doctest::TestCaseData&) override {}

    std::string binary;
};

}  // namespace
}  // namespace test

REGISTER_LISTENER("skipped-for-want-of-data", 1, test::SkipListener);
