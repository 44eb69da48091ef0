// command_line.hpp — the option parser the example programs share. Each program names the options it takes; anything
// else, a missing value or a malformed number is an infer::Error that names the option, so a typo never runs silently.
#pragma once

#include "infer.hpp"

#include <algorithm>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <vector>

class CommandLine {
public:
    // Reads argv[first..]: options in `with_value` take the next argument, options in `flags` stand alone. -h/--help
    // prints `usage` and exits.
    CommandLine(int argc, char** argv, int first, const std::vector<std::string>& with_value,
                const std::vector<std::string>& flags, const std::string& usage) {
        for (int i = first; i < argc; ++i) {
            std::string name = argv[i];
            if (name == "-h" || name == "--help") {
                std::cout << usage;
                std::exit(0);
            }
            if (std::find(flags.begin(), flags.end(), name) != flags.end()) {
                values_[name] = "1";
            } else if (std::find(with_value.begin(), with_value.end(), name) != with_value.end()) {
                if (i + 1 >= argc) infer::detail::fail("option ", name, " needs a value");
                values_[name] = argv[++i];
            } else {
                infer::detail::fail("unknown option \"", name, "\"\n", usage);
            }
        }
    }

    bool has(const std::string& name) const { return values_.count(name) > 0; }

    std::string text(const std::string& name, const std::string& fallback = "") const {
        auto found = values_.find(name);
        return found == values_.end() ? fallback : found->second;
    }

    // An integer in [low, high]; std::stoll alone would accept "12abc".
    long long integer(const std::string& name, long long fallback, long long low = std::numeric_limits<long long>::min(),
                      long long high = std::numeric_limits<long long>::max()) const {
        if (!has(name)) return fallback;
        const std::string& value = values_.at(name);
        size_t used = 0;
        long long number = 0;
        try {
            number = std::stoll(value, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != value.size() || value.empty()) infer::detail::fail("option ", name, ": \"", value, "\" is not an integer");
        if (number < low || number > high)
            infer::detail::fail("option ", name, ": ", number, " is out of range (", low, "..", high, ")");
        return number;
    }

    double number(const std::string& name, double fallback) const {
        if (!has(name)) return fallback;
        const std::string& value = values_.at(name);
        size_t used = 0;
        double number = 0;
        try {
            number = std::stod(value, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != value.size() || value.empty()) infer::detail::fail("option ", name, ": \"", value, "\" is not a number");
        return number;
    }

private:
    std::map<std::string, std::string> values_;
};

// The model a chapter program runs: the one at `path`, or (empty path) the built-in demo model, with a note saying so.
inline infer::Model model_or_demo(const std::string& path) {
    if (!path.empty()) return infer::load_model(path);
    std::cerr << "note: no -m given, so this runs the built-in demo model (random weights; the figures are real)\n";
    return infer::demo_model();
}
