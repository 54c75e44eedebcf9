// Test tool: writes a Megatron dataset with MegatronWriter from a text file of documents, for
// megatron_reference.py to compare with its own writer.
//   data_megatron_write_tool DOCS PREFIX DTYPE_CODE
// DOCS: one document per line; its sequences separated by '|', each a list of ids separated by
// spaces (an empty line is a document of one empty sequence).
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "switchyard/core/error.h"
#include "switchyard/train/dataset/megatron.h"

int main(int argc, char** argv) {
  using namespace switchyard::train::dataset;
  if (argc != 4) {
    std::cerr << "usage: data_megatron_write_tool DOCS PREFIX DTYPE_CODE\n";
    return 2;
  }
  try {
    std::ifstream in(argv[1]);
    MegatronWriter writer(argv[2], static_cast<MegatronDtype>(std::stoi(argv[3])));
    std::string line;
    while (std::getline(in, line)) {
      std::stringstream sequences(line);
      std::string sequence;
      do {
        sequence.clear();
        std::getline(sequences, sequence, '|');
        std::stringstream ids(sequence);
        std::vector<int32_t> tokens;
        for (int32_t id = 0; ids >> id;) tokens.push_back(id);
        writer.AddSequence(tokens);
      } while (sequences.good());
      writer.EndDocument();
    }
    writer.Finish();
  } catch (const switchyard::Error& e) {
    std::cerr << "data_megatron_write_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
