// ModelAccess: which models a request may use, as a plain set of names. The
// transport edge derives it from the caller's credentials (a bearer token
// restricted to some models); everything below transport sees only this set,
// never who called (DESIGN.md section 5).
#ifndef ATTNSERVE_SERVER_REQUEST_MODEL_ACCESS_H_
#define ATTNSERVE_SERVER_REQUEST_MODEL_ACCESS_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// Immutable and cheap to copy (a shared set); thread-safe.
class ModelAccess {
 public:
  // Every model: the default (no authentication, or an unrestricted token).
  ModelAccess() = default;
  static ModelAccess All() { return ModelAccess(); }
  // Only the named models (by their served name; an alias the client might
  // use is resolved before the check). An empty set allows nothing.
  static ModelAccess Only(absl::flat_hash_set<std::string> models) {
    ModelAccess access;
    access.only_ =
        std::make_shared<const absl::flat_hash_set<std::string>>(std::move(models));
    return access;
  }

  // No model at all (a call whose credentials failed).
  static ModelAccess None() { return Only({}); }

  bool restricted() const { return only_ != nullptr; }
  bool Allows(absl::string_view model) const {
    return only_ == nullptr || only_->contains(model);
  }

  // PermissionDenied unless the model a client asked for -- `requested`, or
  // `default_model` when it named none -- is allowed. Checked on the name,
  // before any lookup: a restricted caller gets the same answer for a model
  // that does not exist as for one it may not use, so it cannot probe for
  // names. Cheap when unrestricted (the default model is not even read).
  template <typename DefaultModelFn>
  absl::Status Check(absl::string_view requested, DefaultModelFn default_model) const {
    if (only_ == nullptr) return absl::OkStatus();
    if (requested.empty()) {
      const std::string name = default_model();
      if (only_->contains(name)) return absl::OkStatus();
      return absl::PermissionDeniedError(absl::StrCat(
          "model: the caller's credentials do not allow the default model '", name, "'"));
    }
    if (only_->contains(requested)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        "model: the caller's credentials do not allow model '", requested, "'"));
  }

 private:
  // Null = every model.
  std::shared_ptr<const absl::flat_hash_set<std::string>> only_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_MODEL_ACCESS_H_
