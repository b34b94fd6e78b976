// The meshproof executable: everything is in harness::run_cli so tests can drive it in-process.
#include <iostream>

#include "harness/verbs/cli.h"

int main(int argc, char** argv) {
  return meshproof::harness::run_cli(argc, argv, std::cout, std::cerr);
}
