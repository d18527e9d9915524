package config

import (
	"bufio"
	"bytes"
	"fmt"
	"strings"
)

// keyLines maps dotted keys to the line they are set on, so that errors
// found after decoding (validation, unknown keys) can name a line. Keys of
// array tables are recorded both with their index ("device[1].index") and
// without it ("device.index", first occurrence).
type keyLines map[string]int

func (k keyLines) line(key string) int { return k[key] }

// indexKeys scans TOML text for table headers and "key =" lines. It does not
// need to understand every TOML construct: anything it misses simply has no
// line in the error message.
func indexKeys(data []byte) keyLines {
	out := keyLines{}
	arrays := map[string]int{}
	table, plain := "", ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
			continue
		case strings.HasPrefix(line, "[["):
			name := strings.TrimSpace(strings.Trim(strings.SplitN(line, "#", 2)[0], "[] \t"))
			i := arrays[name]
			arrays[name] = i + 1
			table, plain = fmt.Sprintf("%s[%d]", name, i), name
			record(out, table, n)
			record(out, plain, n)
		case strings.HasPrefix(line, "["):
			name := strings.TrimSpace(strings.Trim(strings.SplitN(line, "#", 2)[0], "[] \t"))
			table, plain = name, name
			record(out, table, n)
		default:
			key, _, ok := strings.Cut(line, "=")
			if !ok {
				continue
			}
			key = strings.Trim(strings.TrimSpace(key), `"'`)
			if table == "" {
				record(out, key, n)
				continue
			}
			record(out, table+"."+key, n)
			record(out, plain+"."+key, n)
		}
	}
	return out
}

func record(m keyLines, key string, line int) {
	if _, ok := m[key]; !ok {
		m[key] = line
	}
}
