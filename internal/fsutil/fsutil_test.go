package fsutil

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteFileAtomic(t *testing.T) {
	t.Parallel()
	for name, write := range map[string]func(string, []byte, os.FileMode) error{"WriteFileAtomic": WriteFileAtomic, "ReplaceFile": ReplaceFile} {
		dir := t.TempDir()
		path := filepath.Join(dir, "spec.yaml")
		if err := os.WriteFile(path, []byte("old"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := write(path, []byte("new"), 0o644); err != nil {
			t.Fatal(name, err)
		}
		b, err := os.ReadFile(path)
		st, _ := os.Stat(path)
		if err != nil || string(b) != "new" || st.Mode().Perm() != 0o644 {
			t.Fatalf("%s: %q %v %v", name, b, st.Mode(), err)
		}
		ents, _ := os.ReadDir(dir)
		if len(ents) != 1 {
			t.Fatalf("%s: temporary files left: %v", name, ents)
		}
	}
}

func TestWriteFileAtomicErrorNamesPath(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "missing", "x.json")
	err := WriteFileAtomic(path, []byte("x"), 0o644)
	if err == nil || !strings.HasPrefix(err.Error(), "write "+path+": ") || strings.Contains(err.Error(), ".tmp") {
		t.Fatalf("error %v", err)
	}
}
