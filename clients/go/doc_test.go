package kvgate

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"strings"
	"testing"
)

// Every exported name has a doc comment, so that go doc documents the whole API.
func TestEveryExportedNameIsDocumented(t *testing.T) {
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, ".", func(fi fs.FileInfo) bool {
		return !strings.HasSuffix(fi.Name(), "_test.go")
	}, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	pkg := pkgs["kvgate"]
	if pkg == nil || pkg.Files["doc.go"] == nil || pkg.Files["doc.go"].Doc == nil {
		t.Fatal("no package documentation in doc.go")
	}
	var missing []string
	for name, file := range pkg.Files {
		for _, decl := range file.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if d.Name.IsExported() && d.Doc == nil && exportedReceiver(d) {
					missing = append(missing, name+": func "+d.Name.Name)
				}
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					switch s := spec.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() && s.Doc == nil && d.Doc == nil {
							missing = append(missing, name+": type "+s.Name.Name)
						}
						if st, ok := s.Type.(*ast.StructType); ok && s.Name.IsExported() {
							for _, f := range st.Fields.List {
								for _, n := range f.Names {
									if n.IsExported() && f.Doc == nil && f.Comment == nil && !selfExplanatory(s.Name.Name) {
										missing = append(missing, name+": field "+s.Name.Name+"."+n.Name)
									}
								}
							}
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							if n.IsExported() && s.Doc == nil && s.Comment == nil && (d.Doc == nil || len(d.Specs) > 1) {
								missing = append(missing, name+": "+n.Name)
							}
						}
					}
				}
			}
		}
	}
	if len(missing) > 0 {
		t.Fatalf("undocumented: %s", strings.Join(missing, "; "))
	}
}

// exportedReceiver is true for functions and for methods of exported types.
func exportedReceiver(d *ast.FuncDecl) bool {
	if d.Recv == nil || len(d.Recv.List) == 0 {
		return true
	}
	typ := d.Recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	if idx, ok := typ.(*ast.IndexExpr); ok {
		typ = idx.X
	}
	id, ok := typ.(*ast.Ident)
	return ok && id.IsExported()
}

// selfExplanatory lists the wire types whose fields are the OpenAI API's own members, named
// as in its JSON.
func selfExplanatory(typ string) bool {
	switch typ {
	case "Message", "Usage", "ChatCompletion", "ChatChoice", "ChatCompletionChunk", "ChatChunkChoice",
		"Delta", "Completion", "CompletionChoice", "ChatCompletionRequest", "CompletionRequest":
		return true
	}
	return false
}
