#include "store.h"

#include <gloo/rendezvous/file_store.h>

#include <mutex>
#include <thread>

#include "error.h"

namespace gridweave {

namespace {

class FileStore : public Store {
 public:
  explicit FileStore(const std::string& path) : impl_(path) {}
  void set(const std::string& key, const std::vector<char>& value) override { impl_.set(key, value); }
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    return impl_.get(key);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    try {
      impl_.wait(keys, timeout);
    } catch (const std::exception& e) {
      throw Error(ErrorKind::Timeout, std::string("gridweave: store wait timed out: ") + e.what());
    }
  }

 private:
  gloo::rendezvous::FileStore impl_;
};

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
      : prefix_(std::move(prefix) + "/"), inner_(std::move(inner)) {}
  void set(const std::string& key, const std::vector<char>& value) override { inner_->set(prefix_ + key, value); }
  void set_within(const std::string& key, const std::vector<char>& value, std::chrono::milliseconds timeout) override {
    inner_->set_within(prefix_ + key, value, timeout);
  }
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_->get(prefix_ + key, timeout);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    inner_->wait(full, timeout);
  }

 private:
  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

}  // namespace

std::shared_ptr<Store> make_file_store(const std::string& path) { return std::make_shared<FileStore>(path); }

std::shared_ptr<Store> make_prefix_store(const std::string& prefix, std::shared_ptr<Store> inner) {
  return std::make_shared<PrefixStore>(prefix, std::move(inner));
}

}  // namespace gridweave
