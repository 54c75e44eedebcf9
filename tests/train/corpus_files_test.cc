// The run's corpus keys: `data` as several files and directories, `val_data` as a separate
// held-out text, and the default corpus (Debian's full fortunes package; a note with only
// fortunes-min).
#include <gtest/gtest.h>

#include <filesystem>

#include "switchyard/core/error.h"
#include "switchyard/core/file_util.h"
#include "switchyard/train/data.h"
#include "train/temp_dir.h"

namespace switchyard::train {
namespace {

using testing::TempDir;

TEST(CorpusFilesTest, DataTakesFilesAndDirectoriesInOrder) {
  TempDir dir;
  std::filesystem::create_directories(dir / "texts");
  WriteTextFileAtomic(dir / "a.txt", "first file\n%\n");
  WriteTextFileAtomic(dir / "texts/c.txt", "third\n%\n");
  WriteTextFileAtomic(dir / "texts/b.txt", "second\n%\n");
  WriteTextFileAtomic(dir / "texts/b.dat", "index");  // a fortune index: skipped
  std::filesystem::create_symlink(dir / "texts/b.txt", dir / "texts/b.u8");  // skipped
  const std::vector<std::string> files = ExpandDataPaths(dir / "a.txt," + dir / "texts", "data");
  EXPECT_EQ(files,
            (std::vector<std::string>{dir / "a.txt", dir / "texts/b.txt", dir / "texts/c.txt"}));
  const Corpus c = LoadRunCorpus(dir / "a.txt," + dir / "texts", "", 0.0);
  EXPECT_EQ(std::string(c.train.begin(), c.train.end()), "first file\n%\nsecond\n%\nthird\n%\n");

  // Errors name the key and the entry.
  auto error = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  std::string e = error([&] { ExpandDataPaths(dir / "a.txt," + dir / "missing.txt", "data"); });
  EXPECT_NE(e.find("'data': '" + dir / "missing.txt" + "' does not exist"), std::string::npos) << e;
  e = error([&] { ExpandDataPaths(dir / "a.txt,", "val_data"); });
  EXPECT_NE(e.find("'val_data'"), std::string::npos) << e;
  EXPECT_NE(e.find("empty entry"), std::string::npos) << e;
  std::filesystem::create_directories(dir / "empty");
  e = error([&] { ExpandDataPaths(dir / "empty", "data"); });
  EXPECT_NE(e.find("holds no text file"), std::string::npos) << e;
}

TEST(CorpusFilesTest, ValDataIsHeldOutWholeAndDataTrainsWhole) {
  TempDir dir;
  std::string train, held;
  for (int i = 0; i < 50; ++i) train += "training record " + std::to_string(i) + "\n%\n";
  for (int i = 0; i < 5; ++i) held += "held-out record " + std::to_string(i) + "\n%\n";
  WriteTextFileAtomic(dir / "train.txt", train);
  WriteTextFileAtomic(dir / "held.txt", held);
  // val_fraction is not used with val_data.
  const Corpus c = LoadRunCorpus(dir / "train.txt", dir / "held.txt", 0.1);
  EXPECT_EQ(std::string(c.train.begin(), c.train.end()), train);
  EXPECT_EQ(std::string(c.val.begin(), c.val.end()), held);
  EXPECT_EQ(c.val_records, 5);
  EXPECT_EQ(c.files, (std::vector<std::string>{dir / "train.txt", dir / "held.txt"}));
  EXPECT_EQ(RunCorpusFiles(dir / "train.txt", dir / "held.txt"), c.files);
  // Without val_data every k-th record is held out, as before.
  const Corpus split = LoadRunCorpus(dir / "train.txt", "", 0.1);
  EXPECT_EQ(split.val_records, 5);
  EXPECT_EQ(split.train.size() + split.val.size(), train.size());
}

TEST(CorpusFilesTest, DefaultCorpusIsTheFullFortunesPackage) {
  // scripts/setup.sh installs Debian's fortunes (with fortunes-min): about 2.6 MB of text.
  std::string note = "(unset)";
  const Corpus c = LoadRunCorpus("", "", 0.1, &note);
  EXPECT_EQ(note, "");
  EXPECT_GT(c.train.size() + c.val.size(), 2000000u);
  EXPECT_GT(c.files.size(), 20u);
  // With fewer bytes (fortunes-min alone) the note says what is missing.
  TempDir dir;
  WriteTextFileAtomic(dir / "fortunes", "a short fortune\n%\n");
  const std::string small = DefaultCorpusNote(DefaultCorpusFiles(dir.path()));
  EXPECT_NE(small.find("only 18 bytes"), std::string::npos) << small;
  EXPECT_NE(small.find("install the package 'fortunes'"), std::string::npos) << small;
}

}  // namespace
}  // namespace switchyard::train
