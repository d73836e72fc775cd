// The per-op counters (CommStats): a call finds its op's counters by the
// name's pointer when it is the last op's, so the cache must never count one
// op's call under another's name, nor outlive a reset.

#include "backend/CommStats.hpp"

#include <gtest/gtest.h>

#include <string>

namespace {

TEST(CommStats, AlternatingOpsCountUnderTheirOwnNames) {
  hsdp::CommStats stats;
  stats.record("all_reduce", 1, 8);
  stats.record("all_gather_into_tensor", 1, 64);
  stats.record("all_reduce", 2, 16);
  stats.record("all_reduce", 1, 8);
  const auto s = stats.snapshot();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s.at("all_reduce").calls, 3u);
  EXPECT_EQ(s.at("all_reduce").collectives, 4u);
  EXPECT_EQ(s.at("all_reduce").bytes, 32u);
  EXPECT_EQ(s.at("all_gather_into_tensor").calls, 1u);
  EXPECT_EQ(s.at("all_gather_into_tensor").bytes, 64u);
}

TEST(CommStats, ANameAtAnotherAddressIsTheSameOp) {
  hsdp::CommStats stats;
  const std::string a = "broadcast", b = "broadcast"; // two buffers, one name
  stats.record(a.c_str(), 1, 4);
  stats.record(b.c_str(), 1, 4);
  const auto s = stats.snapshot();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s.at("broadcast").calls, 2u);
}

TEST(CommStats, AResetForgetsTheLastOp) {
  hsdp::CommStats stats;
  stats.record("all_reduce", 1, 8);
  stats.reset();
  // The same op again: its counters were freed by the reset and must be made
  // anew, not found through the last op's pointer.
  stats.record("all_reduce", 1, 8);
  const auto s = stats.snapshot();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s.at("all_reduce").calls, 1u);
}

} // namespace
