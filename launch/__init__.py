"""orthon.launch"""
