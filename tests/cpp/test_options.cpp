// The option rules (core/options.h) that Python's offload(), the C++
// EngineOptions and the command line share: accepted values, and one clear
// message for each kind of bad value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/options.h"

using namespace layerstream;

namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

}  // namespace

TEST(Options, BudgetTexts) {
  options::Budget b = options::parse_budget("12GiB");
  EXPECT_FALSE(b.fraction);
  EXPECT_EQ(b.bytes, 12ull << 30);
  b = options::parse_budget(" 40% ");
  EXPECT_TRUE(b.fraction);
  EXPECT_DOUBLE_EQ(b.share, 0.4);
  b = options::parse_budget("AUTO");
  EXPECT_TRUE(b.fraction);
  EXPECT_DOUBLE_EQ(b.share, options::kAutoFraction);
  EXPECT_EQ(options::parse_budget("0").bytes, 0u);
  // A count without a unit is whole bytes; the message names the share forms.
  const std::string half = error_of([] { options::parse_budget("0.5"); });
  EXPECT_HAS(half, "not a whole number of bytes");
  EXPECT_HAS(half, "'50%'");
  EXPECT_HAS(error_of([] { options::parse_budget("1e30"); }), "too large");
  EXPECT_HAS(error_of([] { options::parse_budget("9223372036854775808"); }), "too large");
  EXPECT_HAS(error_of([] { options::parse_budget("150%"); }), "(0, 100]");
  EXPECT_HAS(error_of([] { options::parse_budget("0%"); }), "(0, 100]");
  EXPECT_HAS(error_of([] { options::parse_budget("x%"); }), "(0, 100]");
  EXPECT_HAS(error_of([] { options::parse_budget("12 parsecs"); }), "invalid size");
  // The share forms, which callers without a device refuse by this test.
  EXPECT_TRUE(options::names_share("auto"));
  EXPECT_TRUE(options::names_share(" 50% "));
  EXPECT_TRUE(options::names_share("150%"));  // a share, if a bad one
  EXPECT_FALSE(options::names_share("12GiB"));
  EXPECT_FALSE(options::names_share("0.5"));
}

TEST(Options, BudgetNumbers) {
  options::Budget b = options::budget_from_number(0.25);
  EXPECT_TRUE(b.fraction);
  EXPECT_DOUBLE_EQ(b.share, 0.25);
  b = options::budget_from_number(1e9);
  EXPECT_FALSE(b.fraction);
  EXPECT_EQ(b.bytes, 1000000000u);
  EXPECT_EQ(options::budget_from_number(0).bytes, 0u);
  EXPECT_HAS(error_of([] { options::budget_from_number(1e30); }), "too large");
  EXPECT_HAS(error_of([] { options::budget_from_number(std::nan("")); }), "finite");
  EXPECT_HAS(error_of([] { options::budget_from_number(INFINITY); }), "finite");
  EXPECT_HAS(error_of([] { options::budget_from_number(-1); }), ">= 0");
  EXPECT_HAS(error_of([] { options::budget_from_number(1.5); }), "not a whole number of bytes");
}

TEST(Options, CountsAndLink) {
  EXPECT_EQ(options::check_prefetch(0), 0);
  EXPECT_EQ(options::check_prefetch(options::kMaxPrefetch), options::kMaxPrefetch);
  EXPECT_HAS(error_of([] { options::check_prefetch(-1); }), "prefetch must be in [0, 64]");
  EXPECT_HAS(error_of([] { options::check_prefetch(1000000000); }), "prefetch must be in [0, 64]");
  EXPECT_EQ(options::check_slots(0), 0);  // automatic, where 0 means unset
  EXPECT_EQ(options::check_slots(2), 2);
  EXPECT_HAS(error_of([] { options::check_slots(0, false); }), "slots must be in [2, 66]");
  EXPECT_HAS(error_of([] { options::check_slots(1); }), "slots must be in [2, 66]");
  EXPECT_HAS(error_of([] { options::check_slots(std::numeric_limits<int64_t>::max()); }), "[2, 66]");
  EXPECT_EQ(options::check_link_gbps(0), 0);  // no link model
  EXPECT_EQ(options::check_link_gbps(25), 25);
  EXPECT_HAS(error_of([] { options::check_link_gbps(-1, "--link-gbps"); }), "--link-gbps must be a finite");
  EXPECT_HAS(error_of([] { options::check_link_gbps(std::nan("")); }), "sim_link_gbps must be a finite");
  EXPECT_HAS(error_of([] { options::check_latency_us(INFINITY); }), "sim_latency_us must be a finite");
  EXPECT_EQ(options::check_budget_bytes(-1), -1);
  EXPECT_HAS(error_of([] { options::check_budget_bytes(-2); }), "budget_bytes must be -1");
}

TEST(Options, EngineHostFields) {
  EXPECT_EQ(options::check_byte_cap(-1, "store_pinned_cap"), -1);  // no cap
  EXPECT_EQ(options::check_byte_cap(0, "store_pinned_cap"), 0);
  EXPECT_HAS(error_of([] { options::check_byte_cap(-7, "store_pinned_cap"); }),
             "store_pinned_cap must be -1 (no cap) or a byte count >= 0, got -7");
  EXPECT_EQ(options::check_staging_bytes(0), 0);  // the least needed
  EXPECT_HAS(error_of([] { options::check_staging_bytes(-5); }), "staging_bytes must be a byte count >= 0");
  EXPECT_EQ(options::check_activation_min_bytes(0), 0);
  EXPECT_HAS(error_of([] { options::check_activation_min_bytes(-1); }),
             "activation_min_bytes must be a byte count >= 0");
  EXPECT_EQ(options::check_reader_threads(1), 1);
  EXPECT_HAS(error_of([] { options::check_reader_threads(0); }), "reader_threads must be >= 1");
  EXPECT_HAS(error_of([] { options::check_reader_threads(-1); }), "reader_threads must be >= 1");
}
