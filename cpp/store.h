// Rendezvous key-value store. Python hands in an adapter over torch's TCPStore;
// C++ tests use FileStore. GlooStore adapts any Store to Gloo's rendezvous.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace gridweave {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& value) = 0;
  // Blocks until the key exists or the timeout passes (then throws CommTimeout).
  virtual std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // A set that gives up (CommTimeout) after `timeout`, for the failure path's notes: a store
  // behind a failing link must not hold a failed op longer than its window. Stores whose set
  // never blocks need not override it.
  virtual void set_within(const std::string& key, const std::vector<char>& value, std::chrono::milliseconds timeout) {
    (void)timeout;
    set(key, value);
  }
};

// A store over files in a shared directory (gloo's FileStore underneath).
std::shared_ptr<Store> make_file_store(const std::string& path);

// Every key of `inner` seen under "prefix/".
std::shared_ptr<Store> make_prefix_store(const std::string& prefix, std::shared_ptr<Store> inner);

// Gloo's view of a gridweave Store, with our timeout on every wait.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<gridweave::Store> inner, std::chrono::milliseconds timeout)
      : inner_(std::move(inner)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override { inner_->set(key, data); }
  std::vector<char> get(const std::string& key) override { return inner_->get(key, timeout_); }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, std::min(timeout, timeout_));
  }

 private:
  std::shared_ptr<gridweave::Store> inner_;
  std::chrono::milliseconds timeout_;
};

}  // namespace gridweave
