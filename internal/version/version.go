// Package version holds the build's version, set by the Makefile with
// -ldflags "-X github.com/mgpu-dev/mgpu/internal/version.Version=...".
package version

import (
	"fmt"
	"runtime"
	"strings"
)

// Version is the release version ("dev" in untagged builds).
var Version = "dev"

// Commit is the git commit the build came from.
var Commit = "unknown"

// String returns "VERSION (commit COMMIT, GOVERSION)".
func String() string {
	return fmt.Sprintf("%s (commit %s, %s)", Version, Commit, runtime.Version())
}

// Slug turns a version into a name part: every character other than a
// letter, a digit, '_', '.' or '-' becomes '-', and leading and trailing
// '.' and '-' go (a package version 1.2.3+git4.abc1234 is
// 1.2.3-git4.abc1234). Image tags and installed directories use it.
func Slug(v string) string {
	b := []byte(v)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-') { //nolint:staticcheck // reads as the set it is
			b[i] = '-'
		}
	}
	return strings.Trim(string(b), ".-")
}
